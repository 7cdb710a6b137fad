"""Admission control: refuse work that would wait past its queue deadline anyway.

The jobs ahead of a new one are those waiting in its tier and every higher tier (the shared
queues, the workers' own queues of routed jobs, and the jobs held back for fair share). Workers
count finished jobs in 10-second buckets; the best bucket of the last minute is the measured
capacity, if it holds at least `MIN_MEASURED_JOBS` (fewer measure the demand of a quiet system,
not its capacity). If the jobs ahead, at that rate, would keep the new job waiting past its
queue limit, it is refused with 429 `queue_full` and a `Retry-After` of the excess, rather than
accepted to time out. With no measurement (an idle, quiet or freshly started system),
everything is admitted.

Every submission is decided on a read of Redis made after it arrived or while it arrived, never
on a remembered one: with Redis out, a submission is refused with 503 before anything is stored.
Submissions that arrive while a read is under way share it (`QueueStateReader`), so a burst of
256 POSTs costs a few round trips rather than two each.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
import redis.exceptions

from core import keys
from core.errors import QueueFull, ServiceUnavailable
from core.jobs import NewJob
from core.tiers import TIERS_BY_PRIORITY, Tier
from scheduler.routing import WAITING_SCRIPT, waiting_args

if TYPE_CHECKING:
    from api.services import Services

BUCKET_S = 10
WINDOW_BUCKETS = 6
MIN_MEASURED_JOBS = 20
"""Fewer jobs finished in a bucket than this say nothing about capacity."""


async def waiting_counts(services: Services) -> dict[Tier, int]:
    """Jobs waiting per tier: queued messages (shared and routed) plus jobs held back."""
    counts = await services.redis.eval(WAITING_SCRIPT, 0, *waiting_args())
    return {tier: int(n) for tier, n in zip(TIERS_BY_PRIORITY, counts, strict=True)}


async def measured_capacity(client: aioredis.Redis) -> float:
    """Jobs per second the workers finished in the best complete bucket of the last minute.

    0 (not measured) when no bucket holds `MIN_MEASURED_JOBS`: so few jobs measure how little
    was asked, not what the workers can do. (A warm-up job followed by a batch of 64 once read
    as 0.1 jobs/s, and the batch was refused as if it would wait 630 s.)
    """
    return (await QueueStateReader(client).read()).capacity


@dataclass(frozen=True)
class QueueState:
    """What admission control goes by: the measured capacity and the jobs waiting per tier."""

    capacity: float
    """Jobs per second (0: not measured)."""
    waiting: dict[Tier, int]


class QueueStateReader:
    """Reads the `QueueState` in one round trip, once for every caller that asks meanwhile.

    A caller that asks while a read is under way waits for that read instead of starting its
    own; one that asks after it ended starts the next. No answer outlives its read, so an
    unreachable Redis fails every caller that asks from then on.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client
        self._reading: asyncio.Task[QueueState] | None = None

    async def read(self) -> QueueState:
        """The queue's state as of a read that ended after this call began."""
        task = self._reading
        if task is None:
            task = self._reading = asyncio.ensure_future(self._read())
            task.add_done_callback(self._ended)
        # A caller that goes away (its client hung up) does not cancel the others' read.
        return await asyncio.shield(task)

    def _ended(self, task: asyncio.Task[QueueState]) -> None:
        if self._reading is task:
            self._reading = None
        if not task.cancelled():
            task.exception()  # seen, even when every caller went away before it ended

    async def _read(self) -> QueueState:
        current = int(time.time()) // BUCKET_S
        buckets = [keys.finished_bucket(current - i) for i in range(1, WINDOW_BUCKETS + 1)]
        pipe = self._redis.pipeline(transaction=False)
        pipe.mget(buckets)
        pipe.eval(WAITING_SCRIPT, 0, *waiting_args())
        finished, counts = await pipe.execute()
        best = max(int(count or 0) for count in finished)
        return QueueState(
            capacity=best / BUCKET_S if best >= MIN_MEASURED_JOBS else 0.0,
            waiting={tier: int(n) for tier, n in zip(TIERS_BY_PRIORITY, counts, strict=True)},
        )


async def admit_to_queue(services: Services, batch: list[NewJob]) -> None:
    """Raise `QueueFull` if the batch's jobs would wait past their queue limits."""
    if not batch:
        return
    try:
        state = await services.queue_state.read()
    except redis.exceptions.RedisError as exc:
        # Refused before anything is stored: the job could not be enqueued now anyway.
        raise ServiceUnavailable("The queue is unavailable; retry shortly.") from exc
    capacity, waiting = state.capacity, state.waiting
    if capacity <= 0:
        return
    tier = Tier(batch[0].tier)
    ahead = sum(waiting[t] for t in TIERS_BY_PRIORITY[: TIERS_BY_PRIORITY.index(tier) + 1])
    # The last job of the batch waits for everything ahead plus the rest of the batch; a job
    # with nothing ahead of it is next in line and always admitted (under light load the
    # measured rate is the demand, not the capacity, and would refuse it for nothing).
    wait_s = (ahead + len(batch) - 1) / capacity
    limit_s = min(new.queue_timeout_s or new.timeout_s for new in batch)
    if wait_s <= limit_s:
        return
    retry_after = max(1, math.ceil(wait_s - limit_s))
    raise QueueFull(
        f"The {tier.value} queue is full: {ahead} jobs are waiting ahead, and at the measured "
        f"{capacity:g} jobs/s this {'batch' if len(batch) > 1 else 'job'} would wait about "
        f"{wait_s:.0f} s, past its queue limit of {limit_s:g} s. Retry in {retry_after} s.",
        retry_after=retry_after,
    )
