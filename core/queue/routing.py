"""Prefix routing: jobs whose prompts share a long prefix go to the same worker.

vLLM's prefix cache lives in one engine. Questions about one document spread over several
workers make each of them compute the document; sent to one worker, it is computed once and
every later question reads it from the cache. So a prompt of at least `prefix_route_chars`
characters is keyed by its first `prefix_route_chars` characters, and the key picks a worker by
rendezvous hashing over the live workers of the job's model (each key's choice moves only
when its own worker comes or goes). The job's message goes to that worker's own queue of the tier
(`inferq.{tier}.{worker}`), which the worker polls just before the shared queue of the same
tier, so tier order is kept.

Routing yields to load: a job whose worker already has `prefix_route_backlog` jobs waiting in
its own queue goes to the shared queue instead (a big batch then spreads, and each worker that
takes part computes the document once). A worker's own queues are handed back to the shared
queues of its model's lane by the scheduler's dispatcher as soon as the worker stops being
live, so nothing waits on a worker that is gone (a worker records its lane in
`keys.WORKER_LANES`; see `core.queue.dispatch` for lanes).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from core import keys
from core.queue.wake import WAKE_LUA
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


# ARGV: the workers set, the stats key's prefix and suffix, the workers' lanes hash, then the
# tier queues. Every worker that has started but is no longer live hands its own queues'
# messages over to the shared queues of its lane, oldest at the consuming end. Returns how many
# were moved, and wakes as many waiting workers (`core.queue.wake`).
_RECLAIM = (
    WAKE_LUA
    + """
local moved = 0
for _, name in ipairs(redis.call('SMEMBERS', ARGV[1])) do
  if redis.call('EXISTS', ARGV[2] .. name .. ARGV[3]) == 0 then
    local lane = redis.call('HGET', ARGV[4], name)
    for i = 5, #ARGV do
      local own = ARGV[i] .. '.' .. name
      local shared = ARGV[i]
      if lane then shared = ARGV[i] .. '.model.' .. lane end
      local items = redis.call('LRANGE', own, 0, -1)
      for j = 1, #items do
        redis.call('RPUSH', shared, items[j])
      end
      if #items > 0 then
        redis.call('DEL', own)
        wake(shared, #items)
        moved = moved + #items
      end
      unwake(own)
    end
  end
end
return moved
"""
)

# ARGV: the workers set, the workers' lanes hash, the number of lanes, the lanes ('' for the
# first model's), then per tier: its own queues' base name, then per lane (queue, held count).
# Jobs waiting per tier and lane: the lane's shared queue, the own queues of the lane's workers,
# and the jobs held back for fair share. Tier by tier, lane by lane.
WAITING_SCRIPT = """
local workers = redis.call('SMEMBERS', ARGV[1])
local lanes = tonumber(ARGV[3])
local lane_of = {}
for _, name in ipairs(workers) do
  lane_of[name] = redis.call('HGET', ARGV[2], name) or ''
end
local counts = {}
local i = 4 + lanes
while i <= #ARGV do
  local own = ARGV[i]
  i = i + 1
  for l = 1, lanes do
    local n = redis.call('LLEN', ARGV[i]) + tonumber(redis.call('GET', ARGV[i + 1]) or '0')
    for _, name in ipairs(workers) do
      if lane_of[name] == ARGV[3 + l] then
        n = n + redis.call('LLEN', own .. '.' .. name)
      end
    end
    table.insert(counts, n)
    i = i + 2
  end
end
return counts
"""


def waiting_args(lanes: Sequence[str | None] = (None,)) -> list[str]:
    """The arguments of `WAITING_SCRIPT`, for the deployment's `lanes` (the first is None)."""
    args = [keys.WORKERS_SET, keys.WORKER_LANES, str(len(lanes)), *(lane or "" for lane in lanes)]
    for tier in TIERS_BY_PRIORITY:
        args.append(keys.queue_name(tier))
        for lane in lanes:
            args += [keys.queue_name(tier, lane), keys.held_count(tier, lane)]
    return args


def waiting_by_lane(
    counts: Sequence[int], lanes: Sequence[str | None]
) -> dict[str | None, dict[Tier, int]]:
    """`WAITING_SCRIPT`'s answer for `lanes`: jobs waiting per lane and tier."""
    numbers = iter(counts)
    waiting: dict[str | None, dict[Tier, int]] = {lane: {} for lane in lanes}
    for tier in TIERS_BY_PRIORITY:
        for lane in lanes:
            waiting[lane][tier] = int(next(numbers))
    return waiting


def waiting_counts(client: redis.Redis, lanes: Sequence[str | None] = (None,)) -> dict[str, int]:
    """Jobs waiting per tier over every lane (queued anywhere or held back), from a
    synchronous client."""
    counts = client.eval(WAITING_SCRIPT, 0, *waiting_args(lanes))
    by_lane = waiting_by_lane(counts, lanes)
    return {tier.value: sum(by_lane[lane][tier] for lane in lanes) for tier in TIERS_BY_PRIORITY}


@dataclass(frozen=True)
class LiveWorker:
    """A live worker as routing sees it: the tiers it takes and its lane."""

    tiers: frozenset[Tier]
    lane: str | None


class WorkerDirectory:
    """The live workers, as routing sees them: re-read from Redis at most every `ttl_s`."""

    def __init__(self, client: redis.Redis, ttl_s: float = 1.0) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self._workers: dict[str, LiveWorker] = {}
        self._read_at = float("-inf")
        self._reclaim = client.register_script(_RECLAIM)

    def _read(self) -> dict[str, LiveWorker]:
        """Each live worker (its heartbeat current) with the tiers it takes and its lane."""
        if time.monotonic() - self._read_at >= self.ttl_s:
            members = self.redis.smembers(keys.WORKERS_SET)
            names = sorted(_text(n) for n in members)
            fields = [keys.worker_takes_field(tier) for tier in TIERS_BY_PRIORITY]
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(keys.WORKER_LANES)
            for name in names:
                pipe.exists(keys.worker_stats(name))
                pipe.hmget(keys.worker_stats(name), fields)
            lanes_raw, *replies = pipe.execute()
            lanes = {_text(name): _text(lane) for name, lane in lanes_raw.items()}
            self._workers = {
                name: LiveWorker(
                    frozenset(
                        # A worker that does not say (an older one) takes every tier.
                        tier
                        for tier, takes in zip(TIERS_BY_PRIORITY, flags, strict=True)
                        if takes is None or int(takes)
                    ),
                    lanes.get(name),
                )
                for name, up, flags in zip(names, replies[::2], replies[1::2], strict=True)
                if up
            }
            self._read_at = time.monotonic()
        return self._workers

    def live(self, tier: Tier | None = None) -> list[str]:
        """Names of the live workers of every lane; with `tier`, of those that take its jobs."""
        return [name for name, w in self._read().items() if tier is None or tier in w.tiers]

    def serving(self, lane: str | None, tier: Tier | None = None) -> list[str]:
        """Names of the live workers of one lane; with `tier`, of those that take its jobs."""
        return [name for name in self.live(tier) if self._workers[name].lane == lane]

    def lane_of(self, name: str) -> str | None:
        """The lane of a live worker (None: the first model's, or not live)."""
        worker = self._read().get(name)
        return worker.lane if worker else None

    def reclaim(self) -> int:
        """Move the messages in lost workers' own queues to their lanes' shared queues."""
        prefix, suffix = keys.worker_stats("\0").split("\0")
        args = [keys.WORKERS_SET, prefix, suffix, keys.WORKER_LANES]
        args += [keys.queue_name(tier) for tier in TIERS_BY_PRIORITY]
        return int(self._reclaim(args=args))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
