"""A worker with task events on (`INFERQ_TASK_EVENTS`, for Flower's task pages) runs its jobs
through Celery's own task requests and pool threads rather than the direct strategy: the same
jobs end the same way, Celery's remote control lists those running, and each sends its events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from core.models import Job
from core.queue.app import make_celery_app
from core.tiers import Tier
from tests.support import ExtraWorker, Stack, wait_final, worker_paused

NAME = "events@inferq-test"
JOBS = 3
TOKENS = 6000
"""Several seconds each, so the remote control's inspections see one run: at 2,000 the worker's
main thread, busy with the three jobs' tokens, answered no inspection until they had ended."""


@pytest.fixture
def events_worker(stack: Stack) -> Iterator[ExtraWorker]:
    # Its three long jobs beside the stack's worker left the test Redis waiting for a CPU, and
    # unanswering for up to 15 s, in full CI runs on 2 vCPUs: the name's claim lapsed, and a live
    # worker's job was handed on (its task then ended "skipped"). What this tests is Celery's
    # own requests, not how fast a death is noticed: its claim outlasts such a stall.
    env = {"INFERQ_TASK_EVENTS": "true", "INFERQ_WORKER_NAME_TTL_S": "30"}
    worker = ExtraWorker(stack, NAME, concurrency=4, env=env)
    with worker.running():
        _wait_for_remote_control(stack)
        yield worker


def _wait_for_remote_control(stack: Stack) -> None:
    """Until the events worker answers a ping.

    A worker announces itself ready before its event loop has subscribed to remote control, and
    a broadcast sent in between goes unanswered: the test's first `active()` would then wait out
    its timeout while the jobs (a few seconds each) run to their end unseen.
    """
    app = make_celery_app(stack.local.settings)
    try:
        deadline = time.monotonic() + 60
        while not app.control.ping(destination=[NAME], timeout=1):
            assert time.monotonic() < deadline, f"{NAME} never answered a ping"
    finally:
        app.close()


class EventLog(threading.Thread):
    """Every Celery event on the broker, from the moment it is subscribed."""

    def __init__(self, stack: Stack) -> None:
        super().__init__(name="test-celery-events", daemon=True)
        self.app = make_celery_app(stack.local.settings)
        self.events: list[dict[str, Any]] = []
        self.receiver: Any = None

    def run(self) -> None:
        with self.app.connection_for_read() as connection:
            self.receiver = self.app.events.Receiver(connection, handlers={"*": self.events.append})
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def __enter__(self) -> EventLog:
        self.start()
        deadline = time.monotonic() + 30
        while not self.events:  # the workers' heartbeats: subscribed
            assert time.monotonic() < deadline, "no Celery event arrived"
            time.sleep(0.2)
        return self

    def __exit__(self, *_: object) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.join(timeout=10)
        self.app.close()

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [event for event in list(self.events) if event["type"] == kind]


def _active_job_ids(stack: Stack) -> set[str]:
    """The job ids in the tasks Celery's remote control says the events worker runs now."""
    app = make_celery_app(stack.local.settings)
    try:
        replies = app.control.inspect(destination=[NAME], timeout=1).active() or {}
    finally:
        app.close()
    return {str(task["args"][0]) for task in replies.get(NAME, []) if task["args"]}


def test_jobs_run_through_celerys_own_requests_with_their_events(
    stack: Stack, events_worker: ExtraWorker
) -> None:
    key = stack.create_key(Tier.PREMIUM)
    with worker_paused(stack), EventLog(stack) as log, stack.client(key) as client:
        jobs = [
            stack.submit(key, prompt=f"Events {i}.", max_tokens=TOKENS, ignore_eos=True)
            for i in range(JOBS)
        ]
        ids = {job["id"] for job in jobs}
        deadline = time.monotonic() + 120
        seen_active: set[str] = set()
        while not seen_active and time.monotonic() < deadline:
            seen_active = _active_job_ids(stack) & ids
            if not seen_active and all(
                client.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded" for job_id in ids
            ):
                break  # all ended unseen: the assertion below says so
        finished = [wait_final(client, job["id"]) for job in jobs]
        deadline = time.monotonic() + 30
        while len(log.of_type("task-succeeded")) < JOBS and time.monotonic() < deadline:
            time.sleep(0.2)
    assert seen_active, "Celery's remote control never listed a running job"
    assert [job["status"] for job in finished] == ["succeeded"] * JOBS, finished
    assert all(job["usage"]["completion_tokens"] == TOKENS for job in finished)
    with stack.db.session() as session:
        workers = session.scalars(select(Job.worker).where(Job.id.in_(ids))).all()
    assert set(workers) == {NAME}
    # Flower's task pages: each job's task was received, started and succeeded on that worker.
    received = {e["uuid"]: e for e in log.of_type("task-received") if e["hostname"] == NAME}
    tasks_of_jobs = {
        uuid: job_id for uuid, e in received.items() for job_id in ids if job_id in e["args"]
    }
    assert set(tasks_of_jobs.values()) == ids, received
    started = {e["uuid"] for e in log.of_type("task-started")}
    succeeded = {e["uuid"]: e for e in log.of_type("task-succeeded")}
    assert set(tasks_of_jobs) <= started
    assert set(tasks_of_jobs) <= set(succeeded)
    assert {succeeded[uuid]["result"] for uuid in tasks_of_jobs} == {repr("succeeded")}
