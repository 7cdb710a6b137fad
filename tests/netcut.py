"""Dropping one process's connections to Redis, as a network failure or a proxy's idle
timeout would, while every other client of the same server keeps its own."""

from __future__ import annotations

import contextlib

import psutil
import redis


def cut_redis_connections(client: redis.Redis, pid: int) -> int:
    """Close, on the server, every connection process `pid` holds to `client`'s Redis.

    Redis sees each client at the address the process connects from, so the process's own
    sockets to the server's port name the connections to kill. Returns how many were killed.
    """
    port = client.connection_pool.connection_kwargs.get("port", 6379)
    addresses = {
        f"{conn.laddr.ip}:{conn.laddr.port}"
        for conn in psutil.Process(pid).net_connections(kind="tcp")
        if conn.raddr and conn.raddr.port == port and conn.status == psutil.CONN_ESTABLISHED
    }
    killed = 0
    for address in addresses:
        with contextlib.suppress(redis.ResponseError):  # closed meanwhile
            killed += int(client.client_kill_filter(addr=address))
    return killed
