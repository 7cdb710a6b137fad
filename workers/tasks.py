"""The Celery task: the message carries a job id, the runner does the rest."""

from __future__ import annotations

from celery import Celery

from scheduler.queues import RUN_JOB_TASK
from workers.runner import JobRunner


def register_tasks(app: Celery, runner: JobRunner) -> None:
    """Bind `inferq.run_job` on `app` to `runner`."""

    @app.task(name=RUN_JOB_TASK, ignore_result=True)
    def run_job(job_id: str) -> str | None:
        status = runner.run(job_id)
        return status.value if status is not None else None
