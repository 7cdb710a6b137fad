"""Cancelling running jobs and the two deadlines, with the worker's every slot taken."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest

from core.tiers import Tier
from tests.support import (
    BLOCKER_TOKENS,
    WORKER_CONCURRENCY,
    Stack,
    read_sse,
    streamed_text,
    wait_final,
)

# The job's lifecycle: also run on stock Celery (scripts/test.sh, INFERQ_CELERY_MODE=stock).
pytestmark = pytest.mark.lifecycle


def _moment(job: dict[str, Any], timing: str) -> datetime:
    return datetime.fromisoformat(job["created_at"]) + timedelta(seconds=job["timings"][timing])


def _running(client: httpx.Client) -> list[dict[str, Any]]:
    page = client.get("/v1/jobs", params={"status": "running", "limit": 100}).json()
    jobs: list[dict[str, Any]] = page["data"]
    return jobs


@contextmanager
def full_worker(stack: Stack) -> Iterator[tuple[httpx.Client, list[dict[str, Any]]]]:
    """Every slot of the worker busy with a long premium job; all of them cancelled at exit."""
    key = stack.create_key(Tier.PREMIUM)
    blockers = [
        stack.submit(key, prompt=f"Blocker {i}.", max_tokens=BLOCKER_TOKENS, ignore_eos=True)
        for i in range(WORKER_CONCURRENCY)
    ]
    with stack.client(key) as client:
        deadline = time.monotonic() + 60
        while len(_running(client)) < WORKER_CONCURRENCY:
            assert time.monotonic() < deadline, "the blockers did not all start"
            time.sleep(0.2)
        try:
            yield client, blockers
        finally:
            for blocker in blockers:
                client.delete(f"/v1/jobs/{blocker['id']}")


def test_cancelling_a_running_job_keeps_its_text_and_frees_its_slot(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    with full_worker(stack) as (blocker_client, blockers), stack.client(key) as client:
        waiting = stack.submit(key, prompt="Next in line.", max_tokens=8, ignore_eos=True)
        time.sleep(1.0)
        assert client.get(f"/v1/jobs/{waiting['id']}").json()["status"] == "queued"

        # Cancel once it has made some text (its first tokens may be partial characters).
        read_sse(blocker_client, blockers[0]["id"], until=lambda e: bool(e.get("text")))
        response = blocker_client.delete(f"/v1/jobs/{blockers[0]['id']}")
        assert response.status_code == 200, response.text
        cancelled = response.json()
        assert cancelled["status"] == "cancelled"
        assert cancelled["finish_reason"] == "cancelled"
        assert 0 < cancelled["usage"]["completion_tokens"] < BLOCKER_TOKENS
        assert cancelled["text"]
        events = read_sse(blocker_client, blockers[0]["id"])
        assert events[-1]["type"] == "cancelled"
        assert streamed_text(events) == cancelled["text"]

        started = wait_final(client, waiting["id"])
        assert started["status"] == "succeeded"
        gap_s = (_moment(started, "queue_s") - _moment(cancelled, "total_s")).total_seconds()
        assert gap_s < 1.0, f"the freed slot took {gap_s:.2f}s to start the next job"
        # Cancelling it again: it has ended, and says how.
        again = blocker_client.delete(f"/v1/jobs/{blockers[0]['id']}")
        assert again.status_code == 409
        assert again.json()["error"]["job_status"] == "cancelled"


def test_a_job_queued_past_its_deadline_ends_timed_out_without_running(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    with full_worker(stack), stack.client(key) as client:
        job = stack.submit(key, prompt="Too late.", max_tokens=8, timeout_s=1.0)
        done = wait_final(client, job["id"], timeout_s=30)
        events = read_sse(client, job["id"])
    assert done["status"] == "timed_out"
    assert done["error"]["code"] == "queue_timeout"
    assert done["attempt"] == 0 and done["timings"]["queue_s"] is None
    assert [e["type"] for e in events] == ["timed_out"]


def test_a_running_job_past_its_deadline_is_aborted_with_its_partial_text(stack: Stack) -> None:
    key = stack.create_key(Tier.PREMIUM)
    job = stack.submit(
        key, prompt="Run out of time.", max_tokens=BLOCKER_TOKENS, ignore_eos=True, timeout_s=2.0
    )
    with stack.client(key) as client:
        events = read_sse(client, job["id"])
        done = wait_final(client, job["id"])
    assert done["status"] == "timed_out"
    assert done["error"]["code"] == "run_timeout"
    assert 0 < done["usage"]["completion_tokens"] < BLOCKER_TOKENS
    assert events[-1]["type"] == "timed_out"
    assert streamed_text(events) == done["text"]
