"""The Celery task: the message carries a job id, the runner does the rest."""

from __future__ import annotations

from celery import Celery, Task
from opentelemetry.trace import SpanKind

from core.tracing import context_from, tracer
from scheduler.queues import RUN_JOB_TASK
from workers.runner import JobRunner

TRACE_HEADERS = ("traceparent", "tracestate")


def register_tasks(app: Celery, runner: JobRunner) -> None:
    """Bind `inferq.run_job` on `app` to `runner`."""

    @app.task(name=RUN_JOB_TASK, ignore_result=True, bind=True)
    def run_job(self: Task, job_id: str) -> str | None:
        parent = context_from({name: self.request.get(name) for name in TRACE_HEADERS})
        with tracer().start_as_current_span(
            "inferq.run_job", context=parent, kind=SpanKind.CONSUMER
        ) as span:
            span.set_attribute("inferq.job_id", job_id)
            status = runner.run(job_id)
            span.set_attribute("inferq.status", status.value if status else "skipped")
        return status.value if status is not None else None
