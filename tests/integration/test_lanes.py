"""A further model's jobs stay in its lane: a job whose worker dies goes back to its model's
queues, never to a worker of another model, and waits there for one of its own. Two served
names of the tiny model's files make two models (`INFERQ_MODELS`), on a stack of their own."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from core import keys
from core.models import Job
from core.tiers import Tier
from tests.otlp import OtlpReceiver
from tests.stacks import stack_of_its_own
from tests.support import ExtraWorker, Stack, scrape, value, wait_final

OTHER = "tiny-b"
"""The second model: the tiny model's files under another served name."""
TOKENS = 6000


@pytest.fixture(scope="module")
def lanes_stack(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, otlp: OtlpReceiver
) -> Iterator[Stack]:
    """A stack whose own worker serves the first model, on a Redis and SQLite of its own."""
    env = {"INFERQ_MODELS": json.dumps({OTHER: str(model_dir)})}
    with stack_of_its_own(tmp_path_factory.mktemp("lanes"), model_dir, otlp.url, env=env) as stack:
        yield stack


def _rows(stack: Stack, jobs: list[dict[str, Any]]) -> dict[str, tuple[str, str | None, int]]:
    """(status, worker, attempt) of each job."""
    with stack.db.session() as session:
        rows = session.execute(
            select(Job.id, Job.status, Job.worker, Job.attempt).where(
                Job.id.in_([job["id"] for job in jobs])
            )
        )
        return {job_id: (status, worker, attempt) for job_id, status, worker, attempt in rows}


def test_a_lost_workers_jobs_wait_in_its_models_lane_for_a_worker_of_that_model(
    lanes_stack: Stack,
) -> None:
    stack = lanes_stack
    key = stack.create_key(Tier.PREMIUM)
    first = ExtraWorker(stack, "b1@lanes", concurrency=4, args=["--model", OTHER])
    with first.running():
        assert stack.redis.hget(keys.WORKER_LANES, first.name) == OTHER.encode()
        jobs = [
            stack.submit(key, prompt=f"Lane {i}.", model=OTHER, max_tokens=TOKENS, ignore_eos=True)
            for i in range(4)
        ]
        deadline = time.monotonic() + 60
        while not all(row == ("running", first.name, 1) for row in _rows(stack, jobs).values()):
            assert time.monotonic() < deadline, _rows(stack, jobs)
            time.sleep(0.05)
        first.kill()

        # Handed on: queued again in the lane, where the first model's idle worker never looks.
        deadline = time.monotonic() + 30
        while {status for status, _, _ in _rows(stack, jobs).values()} != {"queued"}:
            assert time.monotonic() < deadline, _rows(stack, jobs)
            time.sleep(0.1)
        time.sleep(2.0)
        assert {status for status, _, _ in _rows(stack, jobs).values()} == {"queued"}
        assert stack.redis.llen(keys.queue_name(Tier.PREMIUM, OTHER)) >= len(jobs)
        # What an autoscaler of the model's workers reads: its own lane's waiting jobs.
        waiting = scrape(f"{stack.api_url}/metrics")
        assert value(waiting, "inferq_queue_length", tier="premium", model=OTHER) == len(jobs)
        first_model = frozenset({"tier": "premium", "model": stack.model_name}.items())
        assert waiting[("inferq_queue_length", first_model)] == 0  # shown, and nothing waits

    second = ExtraWorker(stack, "b2@lanes", concurrency=4, args=["--model", OTHER])
    with second.running(), stack.client(key) as client:
        done = [wait_final(client, job["id"], timeout_s=180) for job in jobs]
    assert [job["status"] for job in done] == ["succeeded"] * len(jobs), done
    assert {row[1:] for row in _rows(stack, jobs).values()} == {(second.name, 2)}
    assert all(job["usage"]["completion_tokens"] == TOKENS for job in done)
    assert all(job["model"] == OTHER for job in done)
