"""Celery's remote control sees the jobs a worker runs with the default (direct) strategy:
`celery inspect active` and Flower's worker page list the running ones, and its counts grow.
"""

from __future__ import annotations

import time
from typing import Any

from core.queue.app import RUN_JOB_TASK, make_celery_app
from core.tiers import Tier
from tests.support import Stack, wait_final

JOBS = 3
TOKENS = 600


def _inspect(stack: Stack, command: str) -> dict[str, Any]:
    app = make_celery_app(stack.local.settings)
    try:
        inspect = app.control.inspect(destination=[stack.worker_name], timeout=2)
        replies: dict[str, Any] = getattr(inspect, command)() or {}
    finally:
        app.close()
    return replies


def _active_job_ids(stack: Stack) -> set[str]:
    tasks = _inspect(stack, "active").get(stack.worker_name, [])
    return {str(task["args"][0]) for task in tasks if task["args"]}


def _run_job_count(stack: Stack) -> int:
    stats = _inspect(stack, "stats").get(stack.worker_name, {})
    return int(stats.get("total", {}).get(RUN_JOB_TASK, 0))


def test_running_jobs_are_listed_by_celerys_remote_control(stack: Stack) -> None:
    key = stack.create_key(Tier.PREMIUM)
    counted_before = _run_job_count(stack)
    with stack.client(key) as client:
        jobs = [
            stack.submit(key, prompt=f"Inspect me {i}.", max_tokens=TOKENS, ignore_eos=True)
            for i in range(JOBS)
        ]
        ids = {job["id"] for job in jobs}
        deadline = time.monotonic() + 60
        seen_active: set[str] = set()
        while not seen_active and time.monotonic() < deadline:
            seen_active = _active_job_ids(stack) & ids
        finished = [wait_final(client, job["id"]) for job in jobs]

    assert seen_active, "Celery's remote control never listed a running job"
    assert [job["status"] for job in finished] == ["succeeded"] * JOBS
    # Ended: no longer listed once the consumer's loop has turned (workers.tasks.ReadyTasks).
    deadline = time.monotonic() + 30
    while _active_job_ids(stack) & ids and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _active_job_ids(stack) & ids
    assert _run_job_count(stack) >= counted_before + JOBS
