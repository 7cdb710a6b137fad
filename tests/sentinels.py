"""A Redis primary, its replica and three Sentinels on loopback, for the failover tests."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from inferq.local import free_port, redis_server_command

SERVICE = "inferq"


@dataclass
class Sentinels:
    """The servers of one Sentinel-watched Redis; `url` is what inferq is given."""

    primary_port: int
    replica_port: int
    sentinel_ports: list[int]
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def primary(self) -> int:
        """The port of the server the Sentinels now name as primary."""
        sentinel = redis.Redis(port=self.sentinel_ports[0], socket_timeout=2)
        address: Any = sentinel.sentinel_get_master_addr_by_name(SERVICE)
        return int(address[1])

    def kill(self, port: int) -> None:
        """SIGKILL the Redis server on `port`: what it had not yet sent its replica is lost."""
        process = self.processes.pop(port)
        process.kill()
        process.wait()


def _ready(port: int, check: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(port=port, socket_timeout=2)
    while True:
        try:
            info = client.info()
            if check in str(info):
                return
        except redis.RedisError:
            pass
        assert time.monotonic() < deadline, f"Redis on {port} not ready ({check})"
        time.sleep(0.1)


@contextmanager
def sentinel_redis(binary: str, tmp: Path) -> Iterator[Sentinels]:
    """Start a primary, a replica of it and three Sentinels that fail over after 1 s down."""
    servers = Sentinels(free_port(), free_port(), [free_port() for _ in range(3)])

    def start(port: int, command: list[str]) -> None:
        servers.processes[port] = subprocess.Popen(command, stdout=subprocess.DEVNULL)

    try:
        for port in (servers.primary_port, servers.replica_port):
            (tmp / str(port)).mkdir()
            command = redis_server_command(binary, port, tmp / str(port))
            if port == servers.replica_port:
                command += ["--replicaof", "127.0.0.1", str(servers.primary_port)]
            start(port, command)
        _ready(servers.replica_port, "'master_link_status': 'up'")
        for port in servers.sentinel_ports:
            config = tmp / f"sentinel-{port}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {tmp}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {servers.primary_port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            start(port, [binary, str(config), "--sentinel"])
        # Each Sentinel knows the replica and the two other Sentinels: a failover can happen.
        deadline = time.monotonic() + 30
        for port in servers.sentinel_ports:
            sentinel = redis.Redis(port=port, socket_timeout=2)
            while True:
                try:
                    master: Any = sentinel.sentinel_master(SERVICE)
                    if master["num-slaves"] >= 1 and master["num-other-sentinels"] >= 2:
                        break
                except redis.RedisError:
                    pass
                assert time.monotonic() < deadline, f"Sentinel {port} did not see the others"
                time.sleep(0.2)
        yield servers
    finally:
        for process in servers.processes.values():
            process.kill()
            process.wait()
