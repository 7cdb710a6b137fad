"""`inferq up`: run the whole system on one machine with embedded defaults."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import redis

from core.redisconn import parse_sentinel, sync_client
from core.settings import Settings

STOP_S = 60
"""How long `stop` waits for each child after SIGTERM (a worker finishes its running jobs)."""


def redis_reachable(url: str) -> bool:
    """Whether a Redis server answers at `url`."""
    try:
        return bool(sync_client(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_server_command(binary: str, port: int, data_dir: Path) -> list[str]:
    """A loopback-only, non-persistent redis-server on `port`."""
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(data_dir)]  # fmt: skip


@dataclass
class LocalStack:
    """Child processes started by `inferq up`, stopped in reverse order."""

    settings: Settings
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    processes: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def ensure_redis(self) -> str:
        """The configured Redis if it answers, else a local server started here."""
        url = self.settings.redis_url
        if redis_reachable(url):
            return url
        host = urlparse(url).hostname or "127.0.0.1"
        if parse_sentinel(url) or host not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit(f"Redis at {url} does not answer, and it is not local to start it.")
        server = shutil.which("redis-server")
        if server is None:
            raise SystemExit(
                "No Redis answers and redis-server is not installed: install it "
                "(e.g. `apt-get install redis-server`) or set INFERQ_REDIS_URL."
            )
        port = free_port()
        data = self.settings.data_dir.resolve() / "redis"
        data.mkdir(parents=True, exist_ok=True)
        self.start("redis", redis_server_command(server, port, data))
        url = f"redis://127.0.0.1:{port}/0"
        for _ in range(50):
            if redis_reachable(url):
                return url
            time.sleep(0.1)
        raise SystemExit("The local redis-server did not start.")

    def start(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        """Start a child process with the stack's environment, in a process group of its own.

        A Ctrl-C at the terminal signals the whole foreground group at once; it would stop
        Redis and vLLM's engine core while the worker still drains its jobs. In their own
        groups the children hear it from `stop` alone, newest first.
        """
        log_dir = self.settings.data_dir.resolve() / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_file = (log_dir / f"{name}.log").open("ab")
        process = subprocess.Popen(
            command, env=self.env, stdout=log_file, stderr=subprocess.STDOUT, process_group=0
        )
        self.processes.append((name, process))
        return process

    def inferq(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """Start an `inferq` subcommand as a child."""
        return self.start(name, [sys.executable, "-m", "inferq", *args])

    def wait_http(self, url: str, timeout_s: float) -> bool:
        """Wait until `url` answers 200, or a child dies."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return False

    def wait_worker(self, redis_url: str, timeout_s: float) -> bool:
        """Wait until a worker's heartbeat shows in Redis, or a child dies."""
        from core.workerinfo import live_workers

        client = sync_client(redis_url)
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                self.check_alive()
                if live_workers(client):
                    return True
                time.sleep(0.5)
            return False
        finally:
            client.close()

    def check_alive(self) -> None:
        """Exit if a child has died."""
        for name, process in self.processes:
            if process.poll() is not None:
                log = self.settings.data_dir.resolve() / "logs" / f"{name}.log"
                raise SystemExit(f"{name} exited with code {process.returncode}; see {log}")

    def stop(self) -> None:
        """SIGTERM every child, newest first; SIGKILL what does not stop within `STOP_S`.

        A child that died, failed or had to be killed may leave processes in its group (a
        worker's engine core, with the engine's memory): its group is killed too, those of
        children that had died already first. A child that stopped cleanly (exit 0) has stopped
        its own, and its group is left to finish (multiprocessing's resource tracker cleans up).
        """
        for _name, process in self.processes:
            if process.poll() not in (None, 0):
                _kill_group(process)
        for _name, process in reversed(self.processes):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=STOP_S)
                except subprocess.TimeoutExpired:
                    _kill_group(process)
                    process.wait()
                if process.returncode != 0:
                    _kill_group(process)
        self.processes.clear()


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL what is left of the process group a child leads (see `LocalStack.start`)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def read_dev_key(data_dir: Path) -> str | None:
    """The key `inferq up` made for local use, if any."""
    path = data_dir / "dev-key"
    return path.read_text().strip() if path.is_file() else None


def write_dev_key(data_dir: Path, key: str) -> None:
    """Keep the local dev key for `inferq submit` (readable by this user only)."""
    path = data_dir / "dev-key"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(key + "\n")
    path.chmod(0o600)


def flower_credentials(data_dir: Path) -> str:
    """`admin:<random>` for the local Flower, made once and kept (readable by this user only)."""
    path = data_dir / "flower-auth"
    if path.is_file():
        return path.read_text().strip()
    import secrets

    credentials = f"admin:{secrets.token_urlsafe(12)}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(credentials + "\n")
    path.chmod(0o600)
    return credentials
