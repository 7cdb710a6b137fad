"""Admission control on a real Redis: what it measures, and how often it reads.

The workers count finished jobs per 10-second bucket; the API takes the best complete bucket of
the last minute as the rate the queue drains at. A bucket holding one warm-up job once read as
0.1 jobs/s, and a batch of 64 submitted next was refused with 429 as if it would wait 630 s.
Submissions that arrive together share one read, and none is decided without a read of its own
time: with Redis gone, every submission is refused with 503.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import redis
import redis.asyncio as aioredis

from api.admission import (
    BUCKET_S,
    MIN_MEASURED_JOBS,
    RATE_BUCKETS,
    QueueStateReader,
    admit_to_queue,
    measured_capacity,
)
from api.services import Services
from core import keys
from core.errors import QueueFull, ServiceUnavailable
from core.new_jobs import NewJob
from core.tiers import Tier
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
            return await measured_capacity(client)
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


def _job() -> NewJob:
    return NewJob(
        owner="alice",
        tier=Tier.BASIC.value,
        prompt="hello",
        sampling_params={"max_tokens": 8},
        timeout_s=60.0,
        prompt_tokens=2,
        queue_timeout_s=30.0,
    )


def _reads(client: redis.Redis) -> int:
    """Admission reads Redis has served: each is one MGET of the finished-job buckets."""
    return int(client.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))


def test_submissions_that_arrive_together_share_one_read_and_none_skips_it(
    tmp_path: Path,
) -> None:
    with redis_server(tmp_path) as server:
        sync = redis.Redis.from_url(server.url)
        current = int(time.time()) // BUCKET_S
        sync.set(keys.finished_bucket(current - 1), 10 * BUCKET_S)  # 10 jobs/s measured

        async def scenario() -> list[BaseException | None]:
            client = aioredis.Redis.from_url(server.url)
            services = cast(
                Services, SimpleNamespace(redis=client, queue_state=QueueStateReader(client))
            )
            try:
                # 50 submissions at once: one read decides them all.
                sync.config_resetstat()
                await asyncio.gather(
                    *(admit_to_queue(services.queue_state, [_job()]) for _ in range(50))
                )
                assert _reads(sync) == 1
                # One after another, each reads for itself: the queue grew meanwhile.
                await admit_to_queue(services.queue_state, [_job()])
                # 400 jobs ahead at 10 jobs/s: 40 s, past the 30 s queue limit.
                sync.rpush(keys.queue_name(Tier.BASIC), *(["m"] * 400))
                with pytest.raises(QueueFull):
                    await admit_to_queue(services.queue_state, [_job()])
                assert _reads(sync) == 3
                # Redis gone: every submission is refused, none admitted on an old answer.
                server.stop()
                outcomes = await asyncio.gather(
                    *(admit_to_queue(services.queue_state, [_job()]) for _ in range(5)),
                    return_exceptions=True,
                )
                return [o if isinstance(o, BaseException) else None for o in outcomes]
            finally:
                await client.aclose()

        outcomes = asyncio.run(scenario())
        assert all(isinstance(o, ServiceUnavailable) for o in outcomes), outcomes


def test_a_basic_job_waits_for_what_the_tiers_above_leave_it(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        sync = redis.Redis.from_url(server.url)
        current = int(time.time()) // BUCKET_S
        # The workers finish 10 jobs/s, but the tiers above take most: basic jobs start at 1/s.
        sync.set(keys.finished_bucket(current - 1), 10 * BUCKET_S)
        for ago in range(1, RATE_BUCKETS + 1):
            sync.set(keys.started_tier_bucket(Tier.BASIC, current - ago), BUCKET_S)
            sync.set(keys.started_tier_bucket(Tier.PREMIUM, current - ago), 9 * BUCKET_S)
        sync.rpush(keys.queue_name(Tier.BASIC), *(["m"] * 40))

        async def scenario() -> tuple[str, int]:
            client = aioredis.Redis.from_url(server.url)
            services = cast(
                Services, SimpleNamespace(redis=client, queue_state=QueueStateReader(client))
            )
            try:
                # 40 basic jobs ahead at 1/s: 40 s, past its 30 s queue limit (at 10 jobs/s,
                # the capacity, it would have been admitted to time out).
                with pytest.raises(QueueFull) as refused:
                    await admit_to_queue(services.queue_state, [_job()])
                # Premium has nothing ahead of it: the basic backlog does not hold it back.
                await admit_to_queue(
                    services.queue_state, [replace(_job(), tier=Tier.PREMIUM.value)]
                )
                # 20 ahead at 1/s fit 30 s, but not once a basic run takes 40 s of its 60 s.
                sync.ltrim(keys.queue_name(Tier.BASIC), 0, 19)
                await admit_to_queue(services.queue_state, [_job()])
                sync.set(keys.finished_tier_bucket(Tier.BASIC, current - 1), 10)
                sync.set(keys.run_ms_bucket(Tier.BASIC, current - 1), 10 * 40_000)
                with pytest.raises(QueueFull) as late:
                    await admit_to_queue(services.queue_state, [_job()])
                return refused.value.message, int(late.value.extra["retry_after"])
            finally:
                await client.aclose()

        message, retry_after = asyncio.run(scenario())
        assert "basic jobs start at about 1/s" in message
        assert retry_after >= 1


def test_a_large_batch_after_a_small_one_counts_the_free_worker_slots(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        sync = redis.Redis.from_url(server.url)
        current = int(time.time()) // BUCKET_S
        # A 50-question warm-up started at about 1.7/s: the rate of what was asked, not of what
        # the workers can take. A live worker with 150 free basic slots says so.
        for ago in range(1, RATE_BUCKETS + 1):
            sync.set(keys.started_tier_bucket(Tier.BASIC, current - ago), 17)
        sync.sadd(keys.WORKERS_SET, "w1", "gone")
        sync.hset(keys.worker_stats("w1"), mapping={keys.worker_room_field(Tier.BASIC): 150})

        async def scenario() -> str:
            client = aioredis.Redis.from_url(server.url)
            reader = QueueStateReader(client)
            try:
                # 200 jobs: 150 start at once, the other 50 wait about 29 s at 1.7/s, within
                # 80% of the 60 s queue limit. Judged at 1.7/s alone: 117 s, refused.
                batch = [replace(_job(), queue_timeout_s=60.0, timeout_s=120.0)] * 200
                await admit_to_queue(reader, batch)
                # 300 would leave 150 waiting: about 88 s, refused, and the message says why.
                with pytest.raises(QueueFull) as refused:
                    await admit_to_queue(reader, batch + batch[:100])
                # A worker whose heartbeat lapsed frees nothing.
                sync.delete(keys.worker_stats("w1"))
                with pytest.raises(QueueFull):
                    await admit_to_queue(reader, batch)
                return refused.value.message
            finally:
                await client.aclose()

        assert "once the 150 free worker slots are taken" in asyncio.run(scenario())


def test_each_model_is_judged_by_its_own_queue_and_workers(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        sync = redis.Redis.from_url(server.url)
        current = int(time.time()) // BUCKET_S
        # The second model's basic jobs start at 1/s and 40 wait for it, 30 of them in its
        # worker's own queue (routed by prefix); its worker has no free slot, the first model's
        # worker has 50.
        for ago in range(1, RATE_BUCKETS + 1):
            sync.set(keys.started_tier_bucket(Tier.BASIC, current - ago, "m2"), BUCKET_S)
        sync.rpush(keys.queue_name(Tier.BASIC, "m2"), *(["m"] * 10))
        sync.rpush(keys.worker_queue_name(Tier.BASIC, "w2"), *(["m"] * 30))
        sync.sadd(keys.WORKERS_SET, "w1", "w2")
        sync.hset(keys.WORKER_LANES, "w2", "m2")
        sync.hset(keys.worker_stats("w1"), mapping={keys.worker_room_field(Tier.BASIC): 50})
        sync.hset(keys.worker_stats("w2"), mapping={keys.worker_room_field(Tier.BASIC): 0})

        async def scenario() -> str:
            client = aioredis.Redis.from_url(server.url)
            reader = QueueStateReader(client, [None, "m2"])
            try:
                states = await reader.read()
                assert states["m2"].waiting[Tier.BASIC] == 40
                assert states[None].waiting[Tier.BASIC] == 0
                assert (states[None].room[Tier.BASIC], states["m2"].room[Tier.BASIC]) == (50, 0)
                # 40 ahead at 1/s: past the 30 s queue limit. The first model's worker's free
                # slots take none of them.
                with pytest.raises(QueueFull) as refused:
                    await admit_to_queue(reader, [replace(_job(), model="m2")])
                # The first model's jobs do not wait for the second's: a batch of 20 is admitted,
                # and so is a batch that mixes them only once the second model's part fits.
                await admit_to_queue(reader, [_job()] * 20)
                with pytest.raises(QueueFull):
                    await admit_to_queue(reader, [_job(), replace(_job(), model="m2")])
                sync.ltrim(keys.worker_queue_name(Tier.BASIC, "w2"), 0, 9)
                await admit_to_queue(reader, [_job(), replace(_job(), model="m2")])
                return refused.value.message
            finally:
                await client.aclose()

        message = asyncio.run(scenario())
        assert message.startswith("The basic queue of the model m2 is full: 40 jobs"), message
