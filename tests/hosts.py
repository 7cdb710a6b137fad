"""Hosts for the multi-host tests, made on this machine as Linux network namespaces.

Each `Host` is a network namespace with its own hostname (a UTS namespace per process run in
it), joined to this machine by a virtual link: `10.231.N.2` inside, `10.231.N.1` outside. It
reaches the test session's Redis and PostgreSQL, which listen on loopback only, through a
`Relay` on its link's outer address. `cut()` takes the link down, as a pulled cable or a
partition would: packets go nowhere and connections hang, nothing is reset.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and the `ip` and `unshare` commands; `socat`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from urllib.parse import urlsplit, urlunsplit


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Relay:
    """Forwards TCP connections from `listen` to `target`, with socat (a process per
    connection, so no relay of one host's traffic waits on another's)."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        socat = shutil.which("socat")
        assert socat, "the multi-host tests relay with socat: install it (apt install socat)"
        (host, port), (to_host, to_port) = listen, target
        self._process = subprocess.Popen(
            [socat, f"TCP-LISTEN:{port},bind={host},fork,reuseaddr", f"TCP:{to_host}:{to_port}"]
        )
        _wait_listening(listen)

    def close(self) -> None:
        self._process.terminate()
        self._process.wait(timeout=10)


def _wait_listening(address: tuple[str, int], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(address, timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {address}"
            time.sleep(0.05)


class Host:
    """A network namespace named `iq-{name}` with hostname `name` (see the module docstring)."""

    def __init__(self, name: str, index: int) -> None:
        self.name = name
        self.namespace = f"iq-{name}"
        self.outer = f"10.231.{index}.1"
        self.address = f"10.231.{index}.2"
        self._link = f"iq{index}out"  # this machine's end of the link
        self._peer = f"iq{index}in"

    def create(self) -> None:
        self.remove()  # what a killed test run may have left
        _ip("netns", "add", self.namespace)
        _ip("link", "add", self._link, "type", "veth", "peer", "name", self._peer)
        _ip("link", "set", self._peer, "netns", self.namespace)
        _ip("addr", "add", f"{self.outer}/24", "dev", self._link)
        _ip("link", "set", self._link, "up")
        inside = ["netns", "exec", self.namespace, "ip"]
        _ip(*inside, "addr", "add", f"{self.address}/24", "dev", self._peer)
        _ip(*inside, "link", "set", self._peer, "up")
        _ip(*inside, "link", "set", "lo", "up")

    def remove(self) -> None:
        subprocess.run(["ip", "link", "del", self._link], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True)

    def cut(self) -> None:
        _ip("link", "set", self._link, "down")

    def restore(self) -> None:
        _ip("link", "set", self._link, "up")

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run on this host: in its namespace, under its own hostname."""
        script = 'hostname "$1" && shift && exec "$@"'
        return [
            "ip", "netns", "exec", self.namespace, "unshare", "--uts",
            "sh", "-c", script, "sh", self.name, *argv,
        ]  # fmt: skip

    def url(self, url: str) -> str:
        """`url` (of a service on this machine's loopback) as this host reaches it."""
        parts = urlsplit(url)
        if parts.hostname not in ("127.0.0.1", "localhost"):
            return url  # not a network service (an SQLite file): the same path here
        assert parts.port, f"{url} names no port"
        netloc = parts.netloc.rsplit("@", 1)
        where = f"{self.outer}:{parts.port}"
        return urlunsplit(
            parts._replace(netloc=f"{netloc[0]}@{where}" if len(netloc) == 2 else where)
        )


@contextmanager
def hosts(names: list[str], services: list[str]) -> Iterator[list[Host]]:
    """Hosts made for a block, each reaching `services` (URLs on loopback) through relays."""
    made = [Host(name, index) for index, name in enumerate(names, start=1)]
    with ExitStack() as cleanup:
        for host in made:
            cleanup.callback(host.remove)
            host.create()
            for url in services:
                parts = urlsplit(url)
                if parts.hostname in ("127.0.0.1", "localhost") and parts.port:
                    relay = Relay((host.outer, parts.port), ("127.0.0.1", parts.port))
                    cleanup.callback(relay.close)
        yield made
