"""Prefix routing: jobs whose prompts share a long prefix go to the same worker.

vLLM's prefix cache lives in one engine. Questions about one document spread over several
workers make each of them compute the document; sent to one worker, it is computed once and
every later question reads it from the cache. So a prompt of at least `prefix_route_chars`
characters is keyed by its first `prefix_route_chars` characters, and the key picks a worker by
rendezvous hashing over the live workers (each key's choice moves only when its own worker
comes or goes). The job's message goes to that worker's own queue of the tier
(`inferq.{tier}.{worker}`), which the worker polls just before the shared queue of the same
tier, so tier order is kept.

Routing yields to load: a job whose worker already has `prefix_route_backlog` jobs waiting in
its own queue goes to the shared queue instead (a big batch then spreads, and each worker that
takes part computes the document once). A worker's own queues are handed back to the shared
queues by the scheduler's dispatcher as soon as the worker stops being live, so nothing waits
on a worker that is gone.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import redis

from core import keys
from core.tiers import TIERS_BY_PRIORITY, Tier


def prefix_key(prompt: str, chars: int) -> str | None:
    """The routing key of a prompt: a digest of its first `chars` characters (None: too short)."""
    if chars <= 0 or len(prompt) < chars:
        return None
    return hashlib.blake2b(prompt[:chars].encode(), digest_size=8).hexdigest()


def pick_worker(route: str, workers: Sequence[str]) -> str | None:
    """The worker a routing key goes to: the highest score of (key, worker) wins."""
    if not workers:
        return None
    return max(
        workers,
        key=lambda name: hashlib.blake2b(f"{route}|{name}".encode(), digest_size=8).digest(),
    )


# ARGV: the workers set, the stats key's prefix and suffix, then the tier queues.
# Every worker that has started but is no longer live hands its own queues' messages over to
# the shared queues, oldest at the consuming end. Returns how many were moved.
_RECLAIM = """
local moved = 0
for _, name in ipairs(redis.call('SMEMBERS', ARGV[1])) do
  if redis.call('EXISTS', ARGV[2] .. name .. ARGV[3]) == 0 then
    for i = 4, #ARGV do
      local own = ARGV[i] .. '.' .. name
      local items = redis.call('LRANGE', own, 0, -1)
      for j = 1, #items do
        redis.call('RPUSH', ARGV[i], items[j])
      end
      if #items > 0 then
        redis.call('DEL', own)
        moved = moved + #items
      end
    end
  end
end
return moved
"""

# ARGV: the workers set, then (tier queue, held count) pairs. Jobs waiting per tier: its shared
# queue, every worker's own queue of the tier, and the jobs held back for fair share.
WAITING_SCRIPT = """
local workers = redis.call('SMEMBERS', ARGV[1])
local counts = {}
for i = 2, #ARGV, 2 do
  local n = redis.call('LLEN', ARGV[i]) + tonumber(redis.call('GET', ARGV[i + 1]) or '0')
  for _, name in ipairs(workers) do
    n = n + redis.call('LLEN', ARGV[i] .. '.' .. name)
  end
  table.insert(counts, n)
end
return counts
"""


def waiting_args() -> list[str]:
    """The arguments of `WAITING_SCRIPT`."""
    args = [keys.WORKERS_SET]
    for tier in TIERS_BY_PRIORITY:
        args += [keys.queue_name(tier), keys.held_count(tier)]
    return args


def waiting_counts(client: redis.Redis) -> dict[str, int]:
    """Jobs waiting per tier (queued anywhere or held back), from a synchronous client."""
    counts = client.eval(WAITING_SCRIPT, 0, *waiting_args())
    return {tier.value: int(n) for tier, n in zip(TIERS_BY_PRIORITY, counts, strict=True)}


class WorkerDirectory:
    """The live workers, as routing sees them: re-read from Redis at most every `ttl_s`."""

    def __init__(self, client: redis.Redis, ttl_s: float = 1.0) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self._tiers: dict[str, frozenset[Tier]] = {}
        self._read_at = float("-inf")
        self._reclaim = client.register_script(_RECLAIM)

    def _read(self) -> dict[str, frozenset[Tier]]:
        """Each live worker (its heartbeat current) with the tiers it takes."""
        if time.monotonic() - self._read_at >= self.ttl_s:
            members = self.redis.smembers(keys.WORKERS_SET)
            names = sorted(n.decode() if isinstance(n, bytes) else str(n) for n in members)
            fields = [keys.worker_takes_field(tier) for tier in TIERS_BY_PRIORITY]
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.exists(keys.worker_stats(name))
                pipe.hmget(keys.worker_stats(name), fields)
            replies = pipe.execute()
            self._tiers = {
                name: frozenset(
                    # A worker that does not say (an older one) takes every tier.
                    tier
                    for tier, takes in zip(TIERS_BY_PRIORITY, flags, strict=True)
                    if takes is None or int(takes)
                )
                for name, up, flags in zip(names, replies[::2], replies[1::2], strict=True)
                if up
            }
            self._read_at = time.monotonic()
        return self._tiers

    def live(self, tier: Tier | None = None) -> list[str]:
        """Names of the live workers; with `tier`, of those that take its jobs."""
        return [name for name, tiers in self._read().items() if tier is None or tier in tiers]

    def reclaim(self) -> int:
        """Move the messages in lost workers' own queues to the shared queues."""
        prefix, suffix = keys.worker_stats("\0").split("\0")
        args = [keys.WORKERS_SET, prefix, suffix]
        args += [keys.queue_name(tier) for tier in TIERS_BY_PRIORITY]
        return int(self._reclaim(args=args))
