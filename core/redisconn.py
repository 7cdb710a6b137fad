"""Redis clients from `INFERQ_REDIS_URL`: one server, or the primary that Redis Sentinel names.

`redis://`, `rediss://` and `unix://` URLs name one server. A Sentinel URL names the Sentinels
and the service they watch:

    redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]

The password is the Redis servers' (the Sentinels are asked without one). Every client made
here asks the Sentinels for the service's current primary and asks again when a connection to
it fails, so after a failover the broker, pub/sub, streams and quotas all follow the new
primary. Celery's broker goes through kombu's Sentinel transport (`celery_broker`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel

SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
SENTINEL_KWARGS = {"socket_timeout": 2, "socket_connect_timeout": 2}
"""How the Sentinels themselves are asked: one that does not answer soon is passed over."""


@dataclass(frozen=True)
class SentinelUrl:
    """What a Sentinel URL names."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None

    def server_kwargs(self) -> dict[str, Any]:
        """How to connect to the primary once the Sentinels have named it."""
        return {"db": self.db, "username": self.username, "password": self.password}


def parse_sentinel(url: str) -> SentinelUrl | None:
    """The Sentinel URL's parts; None for a URL of one server. Raises ValueError if malformed."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        return None
    credentials, _, hosts = parts.netloc.rpartition("@")
    username, _, password = credentials.partition(":")
    sentinels = []
    for host in hosts.split(","):
        name, _, port = host.strip().rpartition(":") if ":" in host else (host.strip(), "", "")
        if not name:
            raise ValueError(f"a Sentinel URL lists host:port pairs, not {host!r}")
        sentinels.append((name, int(port) if port else SENTINEL_PORT))
    path = [segment for segment in parts.path.split("/") if segment]
    if not path or len(path) > 2:
        raise ValueError("a Sentinel URL ends with /service or /service/db")
    return SentinelUrl(
        tuple(sentinels),
        unquote(path[0]),
        int(path[1]) if len(path) == 2 else 0,
        unquote(username) or None,
        unquote(password) or None,
    )


MIN_REDIS_VERSION = (7, 0)
"""The oldest Redis inferq runs on: events are numbered by `XADD 0-*` (7.0), and the workers'
take and the dispatcher pop with a count (6.2)."""


def version_problem(client: redis.Redis) -> str | None:
    """Why this Redis server is too old for inferq, or None: new enough, or not reachable now
    (the caller's own handling of an outage applies)."""
    try:
        version = str(client.info("server")["redis_version"])
    except redis.RedisError:
        return None
    found = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if found >= MIN_REDIS_VERSION:
        return None
    needed = ".".join(map(str, MIN_REDIS_VERSION))
    return f"inferq needs Redis {needed} or later; the server runs {version}"


def sync_client(url: str, **kwargs: Any) -> redis.Redis:
    """A client of the server `url` names (for a Sentinel URL, of the current primary)."""
    sentinel = parse_sentinel(url)
    if sentinel is None:
        return redis.Redis.from_url(url, **kwargs)
    manager = redis.sentinel.Sentinel(list(sentinel.sentinels), sentinel_kwargs=SENTINEL_KWARGS)
    return manager.master_for(sentinel.service, **sentinel.server_kwargs(), **kwargs)


class _BlockingSentinelPool(aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """The primary's connections, at most `max_connections`: past them a caller waits."""


def async_client(
    url: str, *, max_connections: int, timeout: float, **kwargs: Any
) -> aioredis.Redis:
    """An asyncio client of `url`'s server with a pool of at most `max_connections`, where a
    caller past them waits up to `timeout` seconds for one."""
    sentinel = parse_sentinel(url)
    if sentinel is None:
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout, **kwargs
        )
        return aioredis.Redis(connection_pool=pool)
    manager = aiosentinel.Sentinel(list(sentinel.sentinels), sentinel_kwargs=SENTINEL_KWARGS)
    client: aioredis.Redis = manager.master_for(
        sentinel.service,
        connection_pool_class=_BlockingSentinelPool,
        max_connections=max_connections,
        timeout=timeout,
        **sentinel.server_kwargs(),
        **kwargs,
    )
    return client


def celery_broker(url: str) -> tuple[str, dict[str, Any]]:
    """Celery's broker URL and the transport options it needs, for `url`."""
    sentinel = parse_sentinel(url)
    if sentinel is None:
        return url, {}
    auth = ""
    if sentinel.password:
        auth = f"{quote(sentinel.username or '', safe='')}:{quote(sentinel.password, safe='')}@"
    broker = ";".join(
        f"sentinel://{auth}{host}:{port}/{sentinel.db}" for host, port in sentinel.sentinels
    )
    return broker, {"master_name": sentinel.service}
