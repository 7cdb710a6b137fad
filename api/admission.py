"""Admission control: refuse work that would wait past its queue deadline anyway.

Workers count, in 10-second buckets, the jobs they start per tier, and the runs they end with
their run time. A new job of a tier waits for the jobs of its tier ahead of it (the shared
queues, the workers' own queues of routed jobs, and the jobs held back for fair share), less
the live workers' free slots for the tier, which each worker's heartbeat publishes (a job they
have room for starts at once). The rest start at the rate the tier's jobs started over the last
`RATE_BUCKETS` complete buckets, or, if more, at the capacity the tiers above leave it (a tier
with little demand started few jobs). If it would wait past `ADMIT_SHARE` of what its deadline
allows (its queue limit, and its total limit less the time a job of its tier runs), it is
refused with 429 `queue_full` and a `Retry-After`, rather than accepted to time out. The
capacity is the best bucket of finished jobs in the last minute; a tier's start rate counts
once `MIN_MEASURED_JOBS` started in its window. With neither measured (an idle, quiet or
freshly started system), everything is admitted; a job with nothing ahead of it always is.
A rate measured under light load is the demand, not what the workers can take: the free slots
keep it from refusing a large batch sent right after a small one.

Each model (its lane, see `core.keys.queue_name`) is judged alone: the workers count their
starts and ends under their model's lane, and a job waits only for the jobs of its model, so a
flood on one model does not refuse another model's jobs.

Every submission is decided on a read of Redis made after it arrived or while it arrived, never
on a remembered one: with Redis out, a submission is refused with 503 before anything is stored.
Submissions that arrive while a read is under way share it (`QueueStateReader`), so a burst of
256 POSTs costs a few round trips rather than two each.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
import redis.exceptions

from core import keys
from core.errors import QueueFull, ServiceUnavailable
from core.new_jobs import NewJob
from core.queue.routing import WAITING_SCRIPT, waiting_args, waiting_by_lane
from core.tiers import TIERS_BY_PRIORITY, Tier

BUCKET_S = keys.RATE_BUCKET_S
WINDOW_BUCKETS = 6
RATE_BUCKETS = 3
MIN_MEASURED_JOBS = 20
"""Fewer jobs finished in a bucket (or started in a tier's window) say nothing about capacity."""
ADMIT_SHARE = 0.8
"""A job is admitted if its estimated wait is within this share of what its deadline allows:
the estimate lags changes in load by up to `RATE_BUCKETS` buckets."""


# ARGV: the workers set, the workers' lanes hash, the stats key's prefix and suffix, the number
# of lanes, the lanes ('' for the first model's), then one room field per tier. Sums each field
# over the workers of each lane whose stats hash exists (live ones): lane by lane, tier by tier.
_ROOM_SCRIPT = """
local lanes = tonumber(ARGV[5])
local first = 6 + lanes
local width = #ARGV - first + 1
local index, sums = {}, {}
for l = 1, lanes do
  index[ARGV[5 + l]] = l
  for f = 1, width do sums[(l - 1) * width + f] = 0 end
end
for _, name in ipairs(redis.call('SMEMBERS', ARGV[1])) do
  local l = index[redis.call('HGET', ARGV[2], name) or '']
  if l then
    local values = redis.call('HMGET', ARGV[3] .. name .. ARGV[4], unpack(ARGV, first))
    for f = 1, width do
      if values[f] then
        sums[(l - 1) * width + f] = sums[(l - 1) * width + f] + tonumber(values[f])
      end
    end
  end
end
return sums
"""


def _room_args(lanes: Sequence[str | None]) -> list[str]:
    prefix, suffix = keys.worker_stats("\0").split("\0")
    return [
        keys.WORKERS_SET,
        keys.WORKER_LANES,
        prefix,
        suffix,
        str(len(lanes)),
        *(lane or "" for lane in lanes),
        *map(keys.worker_room_field, TIERS_BY_PRIORITY),
    ]


async def waiting_counts(
    client: aioredis.Redis, lanes: Sequence[str | None] = (None,)
) -> dict[str | None, dict[Tier, int]]:
    """Jobs waiting in each of the `lanes` per tier: queued messages (shared and routed) plus
    jobs held back."""
    counts = await client.eval(WAITING_SCRIPT, 0, *waiting_args(lanes))
    return waiting_by_lane(counts, lanes)


async def measured_capacity(client: aioredis.Redis) -> float:
    """Jobs per second the workers finished in the best complete bucket of the last minute.

    0 (not measured) when no bucket holds `MIN_MEASURED_JOBS`: so few jobs measure how little
    was asked, not what the workers can do (a warm-up job followed by a batch of 64 would read
    as 0.1 jobs/s, and the batch be refused as if it would wait 630 s).
    """
    return (await QueueStateReader(client).read())[None].capacity


@dataclass(frozen=True)
class QueueState:
    """What admission control goes by for one lane (the jobs of one model, see
    `core.keys.queue_name`): the measured capacity and the jobs waiting per tier."""

    capacity: float
    """Jobs per second (0: not measured)."""
    waiting: dict[Tier, int]
    started: dict[Tier, float]
    """Jobs per second each tier's queue drained at (0: not measured)."""
    run_s: dict[Tier, float]
    """Seconds a run of each tier's jobs took on average in the last minute (0: none ended)."""
    room: dict[Tier, int]
    """Jobs of each tier the live workers would take now (their last heartbeat's free slots)."""


class QueueStateReader:
    """Reads the `QueueState` in one round trip, once for every caller that asks meanwhile.

    A caller that asks while a read is under way waits for that read instead of starting its
    own; one that asks after it ended starts the next. No answer outlives its read, so an
    unreachable Redis fails every caller that asks from then on.
    """

    def __init__(self, client: aioredis.Redis, lanes: Sequence[str | None] = (None,)) -> None:
        self._redis = client
        self._lanes = list(lanes)
        self._reading: asyncio.Task[dict[str | None, QueueState]] | None = None

    def lane_of(self, model: str | None) -> str | None:
        """The lane of a job's model (as `core.settings.Settings.lane_of`)."""
        return model if model is not None and model in self._lanes else None

    async def read(self) -> dict[str | None, QueueState]:
        """Each lane's state as of a read that ended after this call began."""
        task = self._reading
        if task is None:
            task = self._reading = asyncio.ensure_future(self._read())
            task.add_done_callback(self._ended)
        # A caller that goes away (its client hung up) does not cancel the others' read.
        return await asyncio.shield(task)

    def _ended(self, task: asyncio.Task[dict[str | None, QueueState]]) -> None:
        if self._reading is task:
            self._reading = None
        if not task.cancelled():
            task.exception()  # seen, even when every caller went away before it ended

    async def _read(self) -> dict[str | None, QueueState]:
        current = int(time.time()) // BUCKET_S
        window = range(current - WINDOW_BUCKETS, current)
        names: list[str] = []
        for lane in self._lanes:
            names += [keys.finished_bucket(b, lane) for b in window]
            for tier in TIERS_BY_PRIORITY:
                names += [keys.started_tier_bucket(tier, b, lane) for b in window[-RATE_BUCKETS:]]
                names += [keys.finished_tier_bucket(tier, b, lane) for b in window]
                names += [keys.run_ms_bucket(tier, b, lane) for b in window]
        pipe = self._redis.pipeline(transaction=False)
        pipe.mget(names)
        pipe.eval(WAITING_SCRIPT, 0, *waiting_args(self._lanes))
        pipe.eval(_ROOM_SCRIPT, 0, *_room_args(self._lanes))
        values, counts, rooms = await pipe.execute()
        numbers = iter([int(value or 0) for value in values])
        waiting = waiting_by_lane(counts, self._lanes)
        free = iter(int(n) for n in rooms)
        states: dict[str | None, QueueState] = {}
        for lane in self._lanes:
            best = max(next(numbers) for _ in window)
            started: dict[Tier, float] = {}
            run_s: dict[Tier, float] = {}
            for tier in TIERS_BY_PRIORITY:
                starts = sum(next(numbers) for _ in range(RATE_BUCKETS))
                finished = sum(next(numbers) for _ in window)
                run_ms = sum(next(numbers) for _ in window)
                measured = starts >= MIN_MEASURED_JOBS
                started[tier] = starts / (RATE_BUCKETS * BUCKET_S) if measured else 0
                run_s[tier] = run_ms / 1000 / finished if finished else 0.0
            states[lane] = QueueState(
                capacity=best / BUCKET_S if best >= MIN_MEASURED_JOBS else 0.0,
                waiting=waiting[lane],
                started=started,
                run_s=run_s,
                room={tier: next(free) for tier in TIERS_BY_PRIORITY},
            )
        return states


async def admit_to_queue(queue_state: QueueStateReader, batch: list[NewJob]) -> None:
    """Raise `QueueFull` if the batch's jobs would wait past what their deadlines allow.

    The jobs of each model are judged by that model's queues and workers alone.
    """
    if not batch:
        return
    try:
        states = await queue_state.read()
    except redis.exceptions.RedisError as exc:
        # Refused before anything is stored: the job could not be enqueued now anyway.
        raise ServiceUnavailable("The queue is unavailable; retry shortly.") from exc
    by_lane: dict[str | None, list[NewJob]] = {}
    for new in batch:
        by_lane.setdefault(queue_state.lane_of(new.model), []).append(new)
    for lane, jobs in by_lane.items():
        _admit(states[lane], jobs, lane)


def _admit(state: QueueState, batch: list[NewJob], lane: str | None) -> None:
    """Raise `QueueFull` if the jobs of one lane would wait past what their deadlines allow."""
    tier = Tier(batch[0].tier)
    # What the tier's queue drains at: what its jobs started at, or, if more, the capacity the
    # tiers above leave it (a tier with little demand started few jobs, and could start more).
    above = TIERS_BY_PRIORITY[: TIERS_BY_PRIORITY.index(tier)]
    left = state.capacity - sum(state.started[t] for t in above) if state.capacity > 0 else 0.0
    rate = max(state.started[tier], left)
    if rate <= 0:
        return
    ahead, pace = state.waiting[tier], f"{tier.value} jobs start at about {rate:.3g}/s"
    # The last job of the batch waits for everything ahead plus the rest of the batch; a job
    # with nothing ahead of it is next in line and always admitted (under light load the
    # measured rate is the demand, not the capacity, and would refuse it for nothing).
    if ahead + len(batch) - 1 == 0:
        return
    # The jobs the workers have free slots for start at once: a large batch right after a small
    # one is judged by what the workers can take, not only by the rate the small one started at.
    free = state.room[tier]
    wait_s = max(ahead + len(batch) - 1 - free, 0) / rate
    queue_limit_s = min(new.queue_timeout_s or new.timeout_s for new in batch)
    run_s = state.run_s[tier]
    allowed_s = min(queue_limit_s, min(new.timeout_s for new in batch) - run_s)
    if wait_s <= ADMIT_SHARE * allowed_s:
        return
    retry_after = max(1, math.ceil(wait_s - ADMIT_SHARE * max(allowed_s, 0)))
    runs = f" (less the {run_s:.1f} s a {tier.value} job runs)" if run_s else ""
    if free:
        pace += f" once the {free} free worker slots are taken"
    queue = f"{tier.value} queue" + (f" of the model {lane}" if lane else "")
    raise QueueFull(
        f"The {queue} is full: {ahead} jobs are waiting ahead, and at {pace} this "
        f"{'batch' if len(batch) > 1 else 'job'} would wait about {wait_s:.0f} s, past what its "
        f"queue limit of {queue_limit_s:g} s allows{runs}. Retry in {retry_after} s.",
        retry_after=retry_after,
    )
