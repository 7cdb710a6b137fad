"""The job pipeline end to end: HTTP → Redis tier queue → Celery worker → vLLM → database."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import pytest

from core.queue.app import enqueue_job, make_celery_app
from core.settings import Settings
from core.tiers import Tier
from tests.support import BLOCKER_TOKENS, WORKER_CONCURRENCY, Stack, wait_final
from workers.tiny_model import build_tokenizer_json

# The job's lifecycle: also run on stock Celery (scripts/test.sh, INFERQ_CELERY_MODE=stock).
pytestmark = pytest.mark.lifecycle


def _submit(stack: Stack, key: str, **body: Any) -> dict[str, Any]:
    return stack.submit(key, **body)


def _interval(job: dict[str, Any]) -> tuple[datetime, datetime]:
    created = datetime.fromisoformat(job["created_at"])
    timings = job["timings"]
    return created + timedelta(seconds=timings["queue_s"]), created + timedelta(
        seconds=timings["total_s"]
    )


def _max_overlap(jobs: list[dict[str, Any]]) -> int:
    edges = []
    for job in jobs:
        start, end = _interval(job)
        edges += [(start, 1), (end, -1)]
    running = peak = 0
    for _moment, step in sorted(edges, key=lambda edge: (edge[0], edge[1])):
        running += step
        peak = max(peak, running)
    return peak


def test_submit_then_poll_returns_text_and_token_counts(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    prompt = "Tell me about queues: ü, 漢字."
    job = _submit(stack, key, prompt=prompt, max_tokens=24, ignore_eos=True)
    assert job["status"] == "queued"
    assert job["tier"] == "standard"

    with stack.client(key) as client:
        done = wait_final(client, job["id"])

    from tokenizers import Tokenizer

    expected_prompt_tokens = len(Tokenizer.from_str(build_tokenizer_json()).encode(prompt).ids)
    assert done["status"] == "succeeded", done
    assert isinstance(done["text"], str)
    assert done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == 24
    assert done["usage"]["prompt_tokens"] == expected_prompt_tokens == len(prompt.encode()) + 1
    timings = done["timings"]
    assert 0 <= timings["queue_s"] <= timings["ttft_s"] <= timings["total_s"]
    assert done["error"] is None
    assert done["attempt"] == 1


def test_64_jobs_run_concurrently_in_the_engine(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    with ThreadPoolExecutor(16) as pool:
        jobs = list(
            pool.map(
                # Long enough that all 64 are posted well before the first one ends.
                lambda i: _submit(
                    stack, key, prompt=f"Job number {i}.", max_tokens=1000, ignore_eos=True
                ),
                range(64),
            )
        )
    with stack.client(key) as client:
        finished = [wait_final(client, job["id"]) for job in jobs]
    assert all(job["status"] == "succeeded" for job in finished)
    assert all(job["usage"]["completion_tokens"] == 1000 for job in finished)
    # Seen from the jobs' own timestamps, and from the worker's own count.
    assert _max_overlap(finished) >= 16
    assert stack.worker_stats()["peak_in_flight"] >= 16
    # A job in flight is a place in the engine, not a thread: after 64 jobs, 32 at a time, the
    # worker has fewer threads than it runs jobs at once (a thread per job would pass that).
    # Stock Celery's strategy holds a pool thread per job: that is part of its cost.
    if Settings().celery_mode == "inferq":
        assert _threads(stack.local.processes) < WORKER_CONCURRENCY


def _threads(processes: list[tuple[str, Any]]) -> int:
    """How many threads the stack's worker process has now."""
    pid = dict(processes)["worker"].pid
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


@contextmanager
def _worker_filled(stack: Stack, key: str) -> Iterator[list[dict[str, Any]]]:
    """Occupy every slot of the worker with long jobs; they are cancelled on the way out.

    The backlog a test then builds is there on purpose: the load earlier tests measured must
    not decide whether admission control accepts it.
    """
    stack.forget_measured_load()
    blockers = [
        _submit(stack, key, prompt=f"Blocker {i}", max_tokens=BLOCKER_TOKENS, ignore_eos=True)
        for i in range(WORKER_CONCURRENCY)
    ]
    try:
        # Every slot busy before the test builds on it (a slot still held by an earlier test's
        # job leaves a blocker queued for a moment).
        with stack.client(key) as client:
            deadline = time.monotonic() + 60
            while len(
                client.get("/v1/jobs", params={"status": "running", "limit": 100}).json()["data"]
            ) < len(blockers):
                assert time.monotonic() < deadline, "the blockers did not all start"
                time.sleep(0.1)
        yield blockers
    finally:
        # Also when the test failed: left running, they would hold the worker for the next tests.
        with stack.client(key) as client:
            _cancel_all(client, blockers)


def _cancel_all(client: Any, jobs: list[dict[str, Any]]) -> None:
    for job in jobs:
        assert client.delete(f"/v1/jobs/{job['id']}").status_code in (200, 202, 409)


def test_premium_job_overtakes_a_backlog_of_basic_jobs(stack: Stack) -> None:
    premium_key = stack.create_key(Tier.PREMIUM)
    basic_key = stack.create_key(Tier.BASIC)
    with _worker_filled(stack, premium_key) as blockers:
        with ThreadPoolExecutor(8) as pool:
            basic = list(
                pool.map(
                    lambda i: _submit(
                        stack, basic_key, prompt=f"Basic {i}", max_tokens=32, ignore_eos=True
                    ),
                    range(50),
                )
            )
        premium = _submit(stack, premium_key, prompt="Premium", max_tokens=32, ignore_eos=True)
        with stack.client(premium_key) as client:
            # The backlog is in place while the worker is still full: free its slots now.
            statuses = {client.get(f"/v1/jobs/{job['id']}").json()["status"] for job in blockers}
            assert statuses == {"running"}, "the blockers ended before the backlog was in place"
    with stack.client(premium_key) as client:
        premium_done = wait_final(client, premium["id"])
    with stack.client(basic_key) as client:
        basic_done = [wait_final(client, job["id"]) for job in basic]

    assert premium_done["status"] == "succeeded"
    premium_start, premium_end = _interval(premium_done)
    started_first = [job for job in basic_done if _interval(job)[0] < premium_start]
    finished_first = [job for job in basic_done if _interval(job)[1] < premium_end]
    timeline = sorted((_interval(job), job["tier"]) for job in [*basic_done, premium_done])
    assert len(started_first) <= 1, timeline[:10]  # a slot may free while premium is posted
    assert len(finished_first) < 25, timeline[:30]


def test_cancelled_queued_job_never_reaches_the_engine(stack: Stack) -> None:
    key = stack.create_key(Tier.PREMIUM)
    before = stack.wait_idle()
    with _worker_filled(stack, key) as blockers:
        queued = _submit(stack, key, prompt="Never run me", max_tokens=16)
        with stack.client(key) as client:
            cancelled = client.delete(f"/v1/jobs/{queued['id']}")
            assert cancelled.status_code == 200, cancelled.text
            assert cancelled.json()["status"] == "cancelled"
    # Leaving frees the worker: cancelling running jobs aborts them in the engine.
    after = stack.wait_idle()
    with stack.client(key) as client:
        final = wait_final(client, queued["id"])
        blockers_done = [wait_final(client, job["id"]) for job in blockers]

    assert final["status"] == "cancelled"
    assert final["attempt"] == 0
    assert final["timings"]["queue_s"] is None  # never started
    assert after["engine_requests"] - before["engine_requests"] == len(blockers)
    assert after["skipped"] > before["skipped"]  # its message arrived and was dropped
    assert all(job["status"] == "cancelled" for job in blockers_done)
    assert all(job["usage"]["completion_tokens"] < BLOCKER_TOKENS for job in blockers_done)


def test_same_idempotency_key_returns_the_same_job(stack: Stack) -> None:
    key = stack.create_key()
    body = {"prompt": "Once only", "max_tokens": 8}
    with stack.client(key) as client:
        first = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "abc-1"})
        again = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "abc-1"})
        other_body = client.post(
            "/v1/jobs", json={**body, "max_tokens": 9}, headers={"Idempotency-Key": "abc-1"}
        )
        listed = client.get("/v1/jobs").json()["data"]
    assert first.status_code == 202
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert other_body.status_code == 409
    assert other_body.json()["error"]["code"] == "idempotency_key_reused"
    assert [job["id"] for job in listed] == [first.json()["id"]]


def test_other_owners_job_is_not_found(stack: Stack) -> None:
    alice, mallory = stack.create_key(), stack.create_key()
    job = _submit(stack, alice, prompt="Alice's secret", max_tokens=4)
    with stack.client(mallory) as client:
        assert client.get(f"/v1/jobs/{job['id']}").status_code == 404
        assert client.get(f"/v1/jobs/{job['id']}", params={"wait": 1}).status_code == 404
        assert client.delete(f"/v1/jobs/{job['id']}").status_code == 404
        assert client.get("/v1/jobs").json()["data"] == []
    with stack.client(alice) as client:
        assert wait_final(client, job["id"])["status"] == "succeeded"


def test_a_task_delivered_twice_produces_one_result(stack: Stack) -> None:
    key = stack.create_key()
    celery = make_celery_app(Settings(redis_url=stack.redis_url))
    before = stack.wait_idle()
    job = _submit(stack, key, prompt="Deliver me twice", max_tokens=64, ignore_eos=True)
    enqueue_job(celery, job["id"], job["tier"])  # a duplicate while it is queued or running
    with stack.client(key) as client:
        first = wait_final(client, job["id"])
        after = stack.wait_idle()
        enqueue_job(celery, job["id"], job["tier"])  # and a redelivery after it finished
        later = stack.wait_idle()
        again = client.get(f"/v1/jobs/{job['id']}").json()
    assert first["status"] == "succeeded"
    assert first["attempt"] == 1
    assert after["engine_requests"] - before["engine_requests"] == 1
    assert later["engine_requests"] == after["engine_requests"]
    assert again == first


def test_list_is_newest_first_with_cursor_and_status_filter(stack: Stack) -> None:
    key = stack.create_key()
    ids = [_submit(stack, key, prompt=f"List {i}", max_tokens=2)["id"] for i in range(5)]
    with stack.client(key) as client:
        for job_id in ids:
            wait_final(client, job_id)
        page1 = client.get("/v1/jobs", params={"limit": 3}).json()
        page2 = client.get("/v1/jobs", params={"limit": 3, "cursor": page1["next_cursor"]}).json()
        succeeded = client.get("/v1/jobs", params={"status": "succeeded"}).json()
        queued = client.get("/v1/jobs", params={"status": "queued"}).json()
    assert [j["id"] for j in page1["data"] + page2["data"]] == list(reversed(ids))
    assert page2["next_cursor"] is None
    assert len(succeeded["data"]) == 5
    assert queued["data"] == []


def test_cancelling_a_finished_job_is_409_with_its_state(stack: Stack) -> None:
    key = stack.create_key()
    job = _submit(stack, key, prompt="Finish first", max_tokens=2)
    with stack.client(key) as client:
        wait_final(client, job["id"])
        response = client.delete(f"/v1/jobs/{job['id']}")
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "job_already_final"
    assert error["job_status"] == "succeeded"


def test_health_and_readiness(stack: Stack) -> None:
    with stack.client(None) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"redis": "ok", "database": "ok"}


def test_deadlines_end_jobs_timed_out_queued_or_running(stack: Stack) -> None:
    key = stack.create_key(Tier.PREMIUM)
    with _worker_filled(stack, key):
        waits_too_long = _submit(stack, key, prompt="Too late", max_tokens=8, timeout_s=0.2)
        time.sleep(0.5)
    with stack.client(key) as client:
        expired = wait_final(client, waits_too_long["id"])
        runs_too_long = _submit(
            stack, key, prompt="Too long", max_tokens=2000, ignore_eos=True, timeout_s=0.3
        )
        overran = wait_final(client, runs_too_long["id"])
    assert expired["status"] == "timed_out"
    assert expired["error"]["code"] == "queue_timeout"
    assert expired["attempt"] == 0  # never reached the engine
    assert overran["status"] == "timed_out"
    assert overran["error"]["code"] == "run_timeout"
    assert 0 < overran["usage"]["completion_tokens"] < 2000


def test_nul_characters_in_prompt_and_output_are_stored(stack: Stack) -> None:
    # PostgreSQL's text types refuse NUL; the byte-level model emits it now and then.
    key = stack.create_key()
    prompt = "before\x00after"
    jobs = [_submit(stack, key, prompt=prompt, max_tokens=256, ignore_eos=True) for _ in range(8)]
    with stack.client(key) as client:
        done = [wait_final(client, job["id"]) for job in jobs]
    assert all(job["status"] == "succeeded" for job in done), [j["error"] for j in done]
    assert all(job["usage"]["prompt_tokens"] == len(prompt.encode()) + 1 for job in done)
