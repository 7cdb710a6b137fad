"""What workers publish about themselves in Redis: names, counters, the model they serve."""

from __future__ import annotations

import json
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Serving:
    """The model a worker's engine serves, and whether it loads that model's LoRA adapters."""

    model: str
    adapters: bool

    def encode(self) -> str:
        """As the worker's heartbeat stores it (`keys.worker_serves`)."""
        return json.dumps({"model": self.model, "adapters": self.adapters})

    @classmethod
    def decode(cls, raw: bytes | str | None) -> Serving | None:
        """From `encode`; None for a missing or malformed value."""
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            return cls(str(data["model"]), bool(data["adapters"]))
        except (ValueError, TypeError, KeyError):
            return None
