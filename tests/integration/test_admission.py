"""Admission control's measured capacity, on a real Redis: a quiet system measures nothing.

The workers count finished jobs per 10-second bucket; the API takes the best complete bucket of
the last minute as the rate the queue drains at. A bucket holding one warm-up job once read as
0.1 jobs/s, and a batch of 64 submitted next was refused with 429 as if it would wait 630 s.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import redis.asyncio as aioredis

from api.admission import BUCKET_S, MIN_MEASURED_JOBS, measured_capacity
from api.services import Services
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
            return await measured_capacity(cast(Services, SimpleNamespace(redis=client)))
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
