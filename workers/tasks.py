"""The Celery task: the message carries a job id, the runner does the rest.

By default the worker's consumer hands each message's job straight to the runner
(`direct_strategy`, a Celery task strategy) and acknowledges the message once the job's
outcome is stored: no request object, pool thread or per-task bookkeeping for each job. Celery's
own strategy, which runs `JobRunner.run` in a pool thread per job, is used with task events on
(Flower's task pages are built from the events it sends) and in the stock mode
(`INFERQ_CELERY_MODE=stock`, see `core.celery_compat`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from celery import Celery, Task
from celery.worker import state as worker_state
from opentelemetry.trace import SpanKind

from core.queue.app import RUN_JOB_TASK
from core.states import JobStatus
from core.tracing import context_from, tracer
from workers.runner import JobRunner

log = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")


def register_tasks(app: Celery, runner: JobRunner, *, direct: bool = True) -> None:
    """Bind `inferq.run_job` on `app` to `runner` (see the module docstring for `direct`)."""
    strategy = partial(direct_strategy, runner, ReadyTasks())
    options: dict[str, Any] = {"Strategy": strategy} if direct else {}

    @app.task(name=RUN_JOB_TASK, ignore_result=True, bind=True, **options)
    def run_job(self: Task, job_id: str) -> str | None:
        parent = context_from({name: self.request.get(name) for name in TRACE_HEADERS})
        with tracer().start_as_current_span(
            "inferq.run_job", context=parent, kind=SpanKind.CONSUMER
        ) as span:
            span.set_attribute("inferq.job_id", job_id)
            status = runner.run(job_id)
            span.set_attribute("inferq.status", status.value if status else "skipped")
        return status.value if status is not None else None


def direct_strategy(
    runner: JobRunner, ready: ReadyTasks, task: Task, app: Celery, consumer: Any, **_: Any
) -> Callable[..., None]:
    """A Celery task strategy: each message's job goes to `runner.submit` at once.

    The message is acknowledged when the job has ended (its outcome stored, or skipped), so
    the worker's prefetch limit still bounds the jobs it holds, and a worker lost meanwhile
    leaves the message to be redelivered. A message without a job id is rejected (dropped).
    """
    errors = consumer.connection_errors
    hub = getattr(consumer, "hub", None)
    if hub is not None:  # the consumer's thread takes the ended tasks off Celery's lists
        hub.on_tick.add(ready.drain)

    def on_message(message: Any, _body: Any, ack: Any, reject: Any, *_: Any, **__: Any) -> None:
        try:
            args = message.decode()[0]
            job_id = args[0]
            if not isinstance(job_id, str):
                raise TypeError(f"job id {job_id!r} is not a string")
        except Exception as exc:  # nothing to run: a redelivery would fail the same way
            log.error("dropping a malformed %s message: %s", RUN_JOB_TASK, exc)
            reject(log, errors)
            return
        span = tracer().start_span(
            "inferq.run_job", context=context_from(message.headers or {}), kind=SpanKind.CONSUMER
        )
        span.set_attribute("inferq.job_id", job_id)
        running = RunningTask(message, task.name, job_id, consumer.hostname)
        worker_state.task_accepted(running)
        ended = ready.put if hub is not None else ready.end
        runner.submit(job_id, partial(_ended, span, partial(ack, log, errors), running, ended))

    return on_message


class RunningTask:
    """A job the direct strategy runs, as Celery's worker state lists it.

    Celery's remote control (`celery inspect active`, Flower's worker page) lists the requests
    in `celery.worker.state.active_requests` and counts the accepted ones by task name; the
    direct strategy makes no `Request`, so this stands in for one from acceptance to the end.
    """

    def __init__(self, message: Any, name: str, job_id: str, hostname: str) -> None:
        headers = message.headers or {}
        self.id = str(headers.get("id") or message.properties.get("correlation_id") or job_id)
        self.name = name
        self.job_id = job_id
        self.hostname = hostname
        self.time_start = time.time()
        self.acknowledged = False
        delivery = message.delivery_info or {}
        self.delivery_info = {
            key: delivery.get(key) for key in ("exchange", "routing_key", "priority", "redelivered")
        }

    def info(self, safe: bool = False) -> dict[str, Any]:
        """What `celery inspect active` reports for this task (Celery's `Request.info`)."""
        return {
            "id": self.id,
            "name": self.name,
            "args": [self.job_id] if not safe else repr([self.job_id]),
            "kwargs": {} if not safe else "{}",
            "type": self.name,
            "hostname": self.hostname,
            "time_start": self.time_start,
            "acknowledged": self.acknowledged,
            "delivery_info": self.delivery_info,
            "worker_pid": os.getpid(),
        }


class ReadyTasks:
    """Tasks of jobs that have ended, taken off Celery's worker state on the consumer's thread.

    Celery's remote control (`celery inspect active`, Flower) walks
    `celery.worker.state.active_requests`, a WeakSet, on the consumer's thread without copying
    it; a task removed from another thread meanwhile makes that walk fail ("Set changed size
    during iteration"). So a job's end is queued here by whichever thread ends it, and the
    consumer's event loop takes the queue off once a turn (`drain`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ended: list[tuple[RunningTask, bool]] = []

    def put(self, running: RunningTask, successful: bool) -> None:
        """Queue an ended task for the next `drain`; any thread."""
        with self._lock:
            self._ended.append((running, successful))

    def drain(self) -> None:
        """Take every queued task off Celery's lists; on the consumer's thread."""
        with self._lock:
            ended, self._ended = self._ended, []
        for running, successful in ended:
            self.end(running, successful)

    @staticmethod
    def end(running: RunningTask, successful: bool) -> None:
        """Take one task off Celery's lists now (where no event loop runs the consumer)."""
        worker_state.task_ready(running, successful=successful)


def _ended(
    span: Any,
    ack: Callable[[], None],
    running: RunningTask | None,
    ready: Callable[[RunningTask, bool], None],
    status: JobStatus | None,
) -> None:
    try:
        span.set_attribute("inferq.status", status.value if status else "skipped")
        span.end()
    finally:  # an unacknowledged message would hold one of the worker's slots
        try:
            ack()
        finally:
            if running is not None:
                running.acknowledged = True
                ready(running, status is JobStatus.SUCCEEDED)
