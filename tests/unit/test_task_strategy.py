"""The direct task strategy's end of a job: its message is acknowledged whatever else fails, and
its task leaves Celery's active list on the consumer's thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from celery.worker import state as worker_state

from core.queue.app import RUN_JOB_TASK
from core.states import JobStatus
from workers.tasks import ReadyTasks, RunningTask, _ended


class BrokenSpan:
    """A tracing span whose exporter raises."""

    def set_attribute(self, *_: object) -> None:
        raise RuntimeError("the span is broken")

    def end(self) -> None:
        raise RuntimeError("the span is broken")


def test_the_message_is_acknowledged_even_when_its_span_fails() -> None:
    acks: list[str] = []
    with pytest.raises(RuntimeError):
        _ended(BrokenSpan(), lambda: acks.append("ack"), None, ReadyTasks.end, JobStatus.SUCCEEDED)
    assert acks == ["ack"]  # else it would hold one of the worker's slots until a reconnect


def _task(index: int) -> RunningTask:
    message = SimpleNamespace(
        headers={"id": f"task-{index}"}, properties={}, delivery_info={"routing_key": "premium"}
    )
    return RunningTask(message, RUN_JOB_TASK, f"job-{index}", "cpu@test")


@pytest.fixture
def accepted() -> Iterator[list[RunningTask]]:
    """Tasks accepted into Celery's worker state, as the consumer's thread does; removed after."""
    tasks: list[RunningTask] = []
    yield tasks
    for task in tasks:
        worker_state.active_requests.discard(task)
        worker_state.requests.pop(task.id, None)


def _accept(tasks: list[RunningTask], index: int) -> RunningTask:
    task = _task(index)
    worker_state.task_accepted(task)
    tasks.append(task)
    return task


def test_a_job_ended_on_another_thread_leaves_the_active_list_at_the_next_drain(
    accepted: list[RunningTask],
) -> None:
    ready = ReadyTasks()
    first, second, third = (_accept(accepted, i) for i in range(3))
    ender = threading.Thread(target=lambda: [ready.put(t, True) for t in (first, second)])
    ender.start()
    ender.join()
    assert {first, second, third} <= set(worker_state.active_requests)  # not touched yet
    ready.drain()  # the consumer's loop, once a turn
    active = set(worker_state.active_requests)
    assert third in active and first not in active and second not in active
    assert first.id not in worker_state.requests and third.id in worker_state.requests


def test_inspect_active_never_sees_the_list_change_under_it(accepted: list[RunningTask]) -> None:
    """`celery inspect active` walks the WeakSet uncopied while jobs end on other threads."""
    ready = ReadyTasks()
    to_end: queue.SimpleQueue[RunningTask | None] = queue.SimpleQueue()

    def end_jobs() -> None:  # the thread that records outcomes
        while (task := to_end.get()) is not None:
            ready.put(task, True)

    ender = threading.Thread(target=end_jobs)
    ender.start()
    try:
        for index in range(20_000):
            to_end.put(_accept(accepted, index))
            [task.info() for task in worker_state.active_requests]  # raises if changed meanwhile
            if index % 50 == 0:
                ready.drain()
    finally:
        to_end.put(None)
        ender.join()
    ready.drain()
    assert not set(accepted) & set(worker_state.active_requests)
