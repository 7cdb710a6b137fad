"""A worker whose Redis connections drop while its engine is full reconnects without taking
more jobs than it has slots.

The jobs it took before the drop still run in its engine, and count against its prefetch
limit after the reconnect as before: the jobs queued meanwhile wait for a free slot (or
another worker) instead of piling up behind them in this worker's engine. Only the worker's
connections are closed (on the Redis server); the API and the scheduler keep theirs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlalchemy import select

from core.models import Job, as_utc
from core.queue.app import make_celery_app
from core.tiers import Tier
from tests.netcut import cut_redis_connections
from tests.support import BLOCKER_TOKENS, WORKER_CONCURRENCY, Stack, wait_final

WAITING = 4
WATCH_AFTER_RECONNECT_S = 3.0
"""How long the test watches the reconnected worker before it frees the slots."""


def _wait_until(condition: Callable[[], bool], failure: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.2)


def _answers_ping(stack: Stack) -> bool:
    """Whether the worker's consumer answers remote control: it is connected again."""
    app = make_celery_app(stack.local.settings)
    try:
        return bool(app.control.ping(destination=[stack.worker_name], timeout=1.0))
    finally:
        app.close()


def _worker_pid(stack: Stack) -> int:
    return next(process.pid for name, process in stack.local.processes if name == "worker")


def test_a_reconnected_worker_takes_no_more_jobs_than_its_slots(stack: Stack) -> None:
    key = stack.create_key(Tier.PREMIUM)
    # The peak is the worker's lifetime's: an earlier test may have run premium jobs on top of
    # an aged basic one, which the tier reserve allows (`workers.reserve`). Here all are premium.
    peak_before = stack.worker_stats()["peak_in_flight"]
    blockers = [
        stack.submit(
            key, prompt=f"Reconnect blocker {i}.", max_tokens=BLOCKER_TOKENS, ignore_eos=True
        )
        for i in range(WORKER_CONCURRENCY)
    ]
    with stack.client(key) as client:
        try:
            _wait_until(
                lambda: stack.worker_stats()["in_flight"] == WORKER_CONCURRENCY,
                "the blockers did not all start",
            )
            waiting = [
                stack.submit(key, prompt=f"Reconnect waiting {i}.", max_tokens=16)
                for i in range(WAITING)
            ]
            assert cut_redis_connections(stack.redis, _worker_pid(stack)) > 0
            _wait_until(lambda: _answers_ping(stack), "the worker did not reconnect")
            # Connected again, with its slots still full: the waiting jobs stay queued.
            deadline = time.monotonic() + WATCH_AFTER_RECONNECT_S
            while time.monotonic() < deadline:
                statuses = [client.get(f"/v1/jobs/{job['id']}").json()["status"] for job in waiting]
                assert statuses == ["queued"] * WAITING, statuses
                time.sleep(0.2)
        finally:
            for job in blockers:
                client.delete(f"/v1/jobs/{job['id']}")
        ended = [wait_final(client, job["id"]) for job in waiting]
    assert [job["status"] for job in ended] == ["succeeded"] * WAITING, ended
    assert stack.worker_stats()["peak_in_flight"] <= max(peak_before, WORKER_CONCURRENCY)
    with stack.db.session() as session:
        rows = {
            job.id: job
            for job in session.scalars(
                select(Job).where(Job.id.in_([job["id"] for job in blockers + waiting]))
            )
        }
    freed = [rows[job["id"]].finished_at for job in blockers]
    first_freed = min(as_utc(moment) for moment in freed if moment is not None)
    for job in waiting:
        started_at = rows[job["id"]].started_at
        assert started_at is not None and as_utc(started_at) >= first_freed
