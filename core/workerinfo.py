"""Reading what workers publish about themselves in Redis (names, counters)."""

from __future__ import annotations

import redis

from core import keys


def live_workers(client: redis.Redis) -> dict[str, dict[str, int]]:
    """Each started worker whose heartbeat is current, with its counters."""
    workers: dict[str, dict[str, int]] = {}
    for raw_name in client.smembers(keys.WORKERS_SET):
        name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        stats = client.hgetall(keys.worker_stats(name))
        if stats:
            workers[name] = {
                (k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in stats.items()
            }
    return workers
