"""Scheduling across tiers and owners: priority, fair share, aging and admission control."""

from __future__ import annotations

import math
import threading
import time
from datetime import datetime, timedelta
from typing import Any

import httpx

from core import keys
from core.tiers import DEFAULT_TIER_POLICIES, Tier
from tests.integration.test_cancel_and_deadlines import full_worker
from tests.support import WORKER_CONCURRENCY, Stack, scrape, wait_final


def _started(job: dict[str, Any]) -> datetime:
    created = datetime.fromisoformat(job["created_at"])
    return created + timedelta(seconds=job["timings"]["queue_s"])


def _batch(stack: Stack, key: str, count: int, **body: Any) -> list[dict[str, Any]]:
    jobs = [{"prompt": f"Job {i}.", "max_tokens": 4, **body} for i in range(count)]
    with stack.client(key) as client:
        response = client.post("/v1/jobs/batch", json={"jobs": jobs})
        assert response.status_code == 202, response.text
        created: list[dict[str, Any]] = response.json()["data"]
        return created


def _finals(stack: Stack, key: str, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    with stack.client(key) as client:
        return [wait_final(client, job["id"], timeout_s=240) for job in jobs]


def test_premium_jobs_behind_100_basic_jobs_each_start_before_another_basic_one(
    stack: Stack,
) -> None:
    basic_key = stack.create_key(Tier.BASIC)
    premium_key = stack.create_key(Tier.PREMIUM)
    with full_worker(stack):
        basic = _batch(stack, basic_key, 100)
        premium = [
            stack.submit(premium_key, prompt=f"Premium {i}.", max_tokens=4) for i in range(5)
        ]
    basic_done = _finals(stack, basic_key, basic)
    premium_done = _finals(stack, premium_key, premium)

    assert all(job["status"] == "succeeded" for job in basic_done + premium_done)
    basic_starts = sorted(_started(job) for job in basic_done)
    for job in premium_done:
        # At most one basic job (a slot freed while the premium jobs were posted) goes first.
        assert sum(start < _started(job) for start in basic_starts) <= 1


def test_a_premium_job_starts_at_once_while_basic_jobs_hold_their_share_of_the_worker(
    stack: Stack,
) -> None:
    basic_key = stack.create_key(Tier.BASIC)
    premium_key = stack.create_key(Tier.PREMIUM)
    share = math.floor(DEFAULT_TIER_POLICIES[Tier.BASIC].engine_share * WORKER_CONCURRENCY)
    flood = _batch(stack, basic_key, 200, max_tokens=512, ignore_eos=True)
    with stack.client(basic_key) as client:
        try:
            # The flood fills basic's share of the worker, and no more: the rest waits queued.
            most = 0
            deadline = time.monotonic() + 60
            while most < share:
                assert time.monotonic() < deadline, f"basic jobs did not fill their share ({most})"
                most = max(most, len(_running_jobs(client)))
                time.sleep(0.1)
            premium, heartbeats = [], []
            for i in range(5):
                premium.append(stack.submit(premium_key, prompt=f"Premium {i}.", max_tokens=8))
                most = max(most, len(_running_jobs(client)))
                heartbeats.append(stack.worker_stats())
                time.sleep(0.3)
            assert stack.queue_lengths()["basic"] > 0, "the flood ended before the premium jobs"
            # What the worker's heartbeat tells admission control: room for premium throughout,
            # and less for basic, held to its share (a snapshot may fall between a basic job's
            # end and the next one's start, so basic's room is not always 0).
            basic_room = keys.worker_room_field(Tier.BASIC)
            premium_room = keys.worker_room_field(Tier.PREMIUM)
            assert all(0 <= b[basic_room] < b[premium_room] for b in heartbeats), heartbeats
            premium_done = _finals(stack, premium_key, premium)
            most = max(most, len(_running_jobs(client)))
        finally:
            for job in flood:
                client.delete(f"/v1/jobs/{job['id']}")
    assert most <= share, f"{most} basic jobs ran at once, past their share of {share}"
    for job in premium_done:
        assert job["status"] == "succeeded", job
        # It started at once, without waiting for a basic job to end (each runs for seconds).
        assert job["timings"]["queue_s"] < 1.0, job["timings"]
    stack.wait_idle(timeout_s=120)


def test_a_premium_job_too_slow_for_its_deadline_holds_basic_jobs_back_while_it_runs(
    stack: Stack,
) -> None:
    basic_key = stack.create_key(Tier.BASIC)
    premium_key = stack.create_key(Tier.PREMIUM)
    tokens = DEFAULT_TIER_POLICIES[Tier.PREMIUM].max_tokens
    # The pace of a premium job alone on the worker: the better of two runs, since one that
    # met a busy moment of the host would give a deadline the flood's pace could still make.
    solo_s = min(
        (alone["timings"]["total_s"] - alone["timings"]["ttft_s"]) / tokens
        for alone in (
            _finals(stack, premium_key, [_long_job(stack, premium_key, tokens)])[0]
            for _ in range(2)
        )
    )
    share = math.floor(DEFAULT_TIER_POLICIES[Tier.BASIC].engine_share * WORKER_CONCURRENCY)
    flood = _batch(stack, basic_key, 300, max_tokens=512, ignore_eos=True)
    holds = _worker_metric(stack, "inferq_tier_holds_for_pace_total", 'tier="basic"')
    with stack.client(basic_key) as client:
        try:
            deadline = time.monotonic() + 60
            while len(_running_jobs(client)) < share:
                assert time.monotonic() < deadline, "basic jobs did not fill their share"
                time.sleep(0.1)
            # Due in 1.2 times what it takes alone: beside a full batch of basic jobs, its
            # tokens come too slowly for that.
            premium = _long_job(stack, premium_key, tokens, timeout_s=tokens * solo_s * 1.2)
            _finals(stack, premium_key, [premium])
        finally:
            for job in flood:
                client.delete(f"/v1/jobs/{job['id']}")
    # The worker held basic back for the premium job's pace: counted as it began (the gauge
    # shows only what the once-a-second heartbeat saw).
    assert _worker_metric(stack, "inferq_tier_holds_for_pace_total", 'tier="basic"') > holds
    assert _worker_metric(stack, "inferq_engine_time_per_token_seconds") > 0
    stack.wait_idle(timeout_s=120)
    time.sleep(1.5)  # the next heartbeat
    assert _worker_metric(stack, "inferq_tier_held_for_pace", 'tier="basic"') == 0.0


def _long_job(stack: Stack, key: str, tokens: int, **body: Any) -> dict[str, Any]:
    return stack.submit(key, prompt="Long.", max_tokens=tokens, ignore_eos=True, **body)


def _worker_metric(stack: Stack, name: str, label: str = "") -> float:
    """The value of the worker's metric `name` (the series that has `label`)."""
    text = httpx.get(stack.worker_metrics_url, timeout=10).text
    return next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + "{") and label in line
    )


def _running_jobs(client: httpx.Client) -> list[dict[str, Any]]:
    page = client.get("/v1/jobs", params={"status": "running", "limit": 100}).json()
    jobs: list[dict[str, Any]] = page["data"]
    return jobs


def test_a_flooding_owner_does_not_starve_another_owner_of_the_same_tier(stack: Stack) -> None:
    flooder = stack.create_key(Tier.BASIC)
    other = stack.create_key(Tier.BASIC)
    with full_worker(stack):
        flood = _batch(stack, flooder, 300)
        later = _batch(stack, other, 3)
        held = stack.queue_lengths()["basic"]
        metrics = scrape(f"{stack.api_url}/metrics")
    flood_done = _finals(stack, flooder, flood)
    later_done = _finals(stack, other, later)

    assert held >= 303 - 5  # all of it waited: 128 in the queue, the rest held per owner
    # What a user watching /metrics sees waiting counts the held jobs too, not only the queue.
    basic = frozenset({"tier": "basic", "model": stack.model_name}.items())
    assert metrics[("inferq_queue_length", basic)] >= 303 - 5
    assert all(job["status"] == "succeeded" for job in flood_done + later_done)
    starts = sorted(_started(job) for job in flood_done + later_done)
    for job in later_done:
        # Round-robin after the queue's backlog: not behind the flood's 172 held jobs.
        assert starts.index(_started(job)) < 128 + 2 * 3 + 10


def test_under_continuous_premium_load_a_basic_job_still_finishes(stack: Stack) -> None:
    premium_key = stack.create_key(Tier.PREMIUM)
    basic_key = stack.create_key(Tier.BASIC)
    submitted: list[dict[str, Any]] = []
    errors: list[Exception] = []
    stop = threading.Event()

    def keep_premium_queue_full() -> None:
        # Jobs of one wave start together and end together, freeing every slot at once: the
        # queue holds more than a whole wave, so the take that refills the slots leaves premium
        # jobs waiting (with less, a basic job got a freed slot at once, without aging).
        while not stop.is_set():
            try:
                if stack.queue_lengths()["premium"] < 2 * WORKER_CONCURRENCY:
                    long = {"max_tokens": 2000, "ignore_eos": True}
                    submitted.extend(_batch(stack, premium_key, WORKER_CONCURRENCY, **long))
            except Exception as exc:  # keep the load going; the test fails if a lull lets it in
                errors.append(exc)
            time.sleep(0.2)

    load = threading.Thread(target=keep_premium_queue_full, daemon=True)
    load.start()
    try:
        # Saturated: every slot busy (the worker's own count) and premium jobs still waiting.
        deadline = time.monotonic() + 90
        while (
            stack.worker_stats()["in_flight"] < WORKER_CONCURRENCY
            or stack.queue_lengths()["premium"] < 8
        ):
            assert time.monotonic() < deadline, "the premium load did not build up"
            time.sleep(0.5)
        basic = stack.submit(basic_key, prompt="Starving?", max_tokens=8)
        with stack.client(basic_key) as client:
            done = wait_final(client, basic["id"], timeout_s=150)
    finally:
        stop.set()
        load.join()
        with stack.client(premium_key) as client:
            for job in submitted:
                client.delete(f"/v1/jobs/{job['id']}")
            premium = [client.get(f"/v1/jobs/{job['id']}").json() for job in submitted]
    assert done["status"] == "succeeded", done
    assert done["timings"]["total_s"] < 120
    # It overtook premium jobs that were waiting when it started (aging, not a lull in the
    # load): submitted before that, they started after it or were still queued at the end.
    overtaken = [
        job
        for job in premium
        if datetime.fromisoformat(job["created_at"]) < _started(done)
        and (job["timings"]["queue_s"] is None or _started(job) > _started(done))
    ]
    assert overtaken, f"the basic job ran when no premium job was waiting: {done}, {errors[:3]}"
    stack.wait_idle(timeout_s=120)


def test_a_batch_that_would_miss_its_queue_deadline_is_refused_with_429(stack: Stack) -> None:
    key = stack.create_key(Tier.BASIC)
    # Let the workers' throughput be measured: it is counted in complete 10-second buckets.
    _finals(stack, key, _batch(stack, key, 40, max_tokens=1))
    time.sleep(10.5 - time.time() % 10)
    with stack.client(key) as client:
        before = len(client.get("/v1/jobs", params={"limit": 100}).json()["data"])
        refused = client.post(
            "/v1/jobs/batch",
            json={
                "jobs": [
                    {"prompt": f"Late {i}.", "max_tokens": 1, "timeout_s": 2} for i in range(500)
                ]
            },
        )
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "queue_full"
        assert "queue limit of 2 s" in error["message"]
        assert int(refused.headers["retry-after"]) >= 1
        # Nothing of it was stored or queued.
        assert len(client.get("/v1/jobs", params={"limit": 100}).json()["data"]) == before

        # A job that fits its deadline is still taken.
        fits = client.post("/v1/jobs", json={"prompt": "On time.", "max_tokens": 1})
        assert fits.status_code == 202, fits.text
        assert wait_final(client, fits.json()["id"])["status"] == "succeeded"
