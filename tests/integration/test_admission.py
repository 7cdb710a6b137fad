"""Admission control's measured capacity, on a real Redis: a quiet system measures nothing.

The workers count finished jobs per 10-second bucket; the API takes the best complete bucket of
the last minute as the rate the queue drains at. A bucket holding one warm-up job once read as
0.1 jobs/s, and a batch of 64 submitted next was refused with 429 as if it would wait 630 s.
Complete buckets do not change, so the API reads them about once per bucket, not per request.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis.asyncio as aioredis

from api.admission import BUCKET_S, MIN_MEASURED_JOBS, MeasuredCapacity
from core import keys
from tests.support import redis_server


def _capacity_with(url: str, finished: dict[int, int]) -> float:
    """The measured capacity when `finished[i]` jobs ended `i` buckets before the current one."""

    async def scenario() -> float:
        client = aioredis.Redis.from_url(url)
        try:
            await client.flushdb()
            current = int(time.time()) // BUCKET_S
            for ago, count in finished.items():
                await client.set(keys.finished_bucket(current - ago), count)
            return await MeasuredCapacity(client).jobs_per_s()
        finally:
            await client.aclose()

    return asyncio.run(scenario())


def test_a_few_finished_jobs_do_not_count_as_the_capacity(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        # One warm-up job, or a trickle just under the threshold: not a measurement.
        assert _capacity_with(server.url, {1: 1}) == 0.0
        assert _capacity_with(server.url, {1: MIN_MEASURED_JOBS - 1, 3: 5}) == 0.0
        # A bucket with enough jobs is one; the best complete bucket of the minute counts.
        assert _capacity_with(server.url, {1: 1, 2: 40, 4: MIN_MEASURED_JOBS}) == 40 / BUCKET_S
        # The current (incomplete) bucket and buckets older than a minute never count.
        assert _capacity_with(server.url, {0: 500, 7: 500}) == 0.0


def test_the_capacity_is_read_once_a_bucket_and_again_once_it_has_settled(tmp_path: Path) -> None:
    async def scenario(url: str) -> list[tuple[float, int]]:
        client = aioredis.Redis.from_url(url)
        now = 1_000_000 * BUCKET_S + 0.2  # 0.2 s into a bucket
        meter = MeasuredCapacity(client, clock=lambda: now)
        bucket = int(now) // BUCKET_S

        async def read(finished_last_bucket: int) -> tuple[float, int]:
            """The capacity read after the bucket before now has `finished_last_bucket` jobs."""
            await client.set(keys.finished_bucket(bucket - 1), finished_last_bucket)
            before = int((await client.info("stats"))["total_commands_processed"])
            capacity = await meter.jobs_per_s()
            after = int((await client.info("stats"))["total_commands_processed"])
            return capacity, after - before - 1  # less the INFO itself

        try:
            reads = [await read(30)]
            # Jobs that ended at the boundary are counted a moment late, and seen once settled.
            now += 0.3
            reads.append(await read(40))
            now += MeasuredCapacity.SETTLE_S
            reads.append(await read(40))
            reads.append(await read(50))  # a late count after that waits for the next bucket
            now += BUCKET_S
            bucket += 1
            reads.append(await read(60))
            return reads
        finally:
            await client.aclose()

    with redis_server(tmp_path) as server:
        reads = asyncio.run(scenario(server.url))
    # (jobs/s, Redis commands) for each request
    assert reads == [(3.0, 1), (3.0, 0), (4.0, 1), (4.0, 0), (6.0, 1)]
