"""`inferq scheduler`: the periodic work no single worker can be trusted with.

Each tick:
- ends every queued job whose queue deadline has passed (`timed_out`, `queue_timeout`), so an
  expired job never reaches an engine even when no worker is free to look at it;
- finds running jobs whose worker lease has lapsed (the worker died or lost Redis for longer
  than `lease_ttl_s`) and puts them back in their tier's queue for the next attempt — or, after
  `max_attempts`, ends them `failed` with `worker_lost`.

Every change is a conditional UPDATE fenced by status and attempt, so several schedulers, or a
scheduler racing a worker that comes back, never move a job twice.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import redis
from celery import Celery

from core import keys
from core.events import EventPublisher
from core.jobs import JobStore
from core.metrics import JOBS_FINISHED, JOBS_REQUEUED
from core.models import Job, as_utc, utcnow
from core.settings import Settings
from core.states import JobStatus
from scheduler.queues import ENQUEUED_AT_HEADER, enqueue_job

log = logging.getLogger(__name__)


@dataclass
class TickReport:
    """What one tick changed."""

    expired: list[str] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class Scheduler:
    """Expires overdue queued jobs and recovers jobs whose worker was lost."""

    def __init__(
        self, settings: Settings, store: JobStore, client: redis.Redis, celery: Celery
    ) -> None:
        self.settings = settings
        self.store = store
        self.redis = client
        self.celery = celery
        self.publisher = EventPublisher(client, settings.job_key_ttl_s)

    def tick(self) -> TickReport:
        """Do one round of periodic work."""
        report = TickReport()
        now = utcnow()
        for job_id, tier in self.store.expire_overdue(now):
            report.expired.append(job_id)
            JOBS_FINISHED.labels(tier, JobStatus.TIMED_OUT.value).inc()
            log.info(
                "job %s timed out in the queue", job_id, extra={"job_id": job_id, "tier": tier}
            )
            self._publish(
                job_id, "timed_out", status=JobStatus.TIMED_OUT.value, error_code="queue_timeout"
            )
        self._reap(now - timedelta(seconds=self.settings.lease_ttl_s), report)
        return report

    def _reap(self, started_before: datetime, report: TickReport) -> None:
        candidates = self.store.running(started_before)
        if not candidates:
            return
        pipe = self.redis.pipeline(transaction=False)
        for job in candidates:
            pipe.exists(keys.job_lease(job.id))
        leased = pipe.execute()
        for job, lease in zip(candidates, leased, strict=True):
            if lease:
                continue
            if job.attempt >= self.settings.max_attempts:
                message = (
                    f"The job's worker was lost {job.attempt} times "
                    f"(max_attempts {self.settings.max_attempts})."
                )
                if self.store.fail_attempt(job, "worker_lost", message):
                    JOBS_FINISHED.labels(job.tier, JobStatus.FAILED.value).inc()
                    log.warning("job %s failed: %s", job.id, message, extra=_job_fields(job))
                    report.failed.append(job.id)
                    self._publish(
                        job.id, "error", status=JobStatus.FAILED.value, error_code="worker_lost"
                    )
            elif self.store.requeue_attempt(job):
                JOBS_REQUEUED.inc()
                log.warning(
                    "job %s: worker %s lost it in attempt %d; requeued",
                    job.id,
                    job.worker,
                    job.attempt,
                    extra=_job_fields(job),
                )
                report.requeued.append(job.id)
                self._publish(
                    job.id,
                    "status",
                    status=JobStatus.QUEUED.value,
                    attempt=job.attempt,
                    reason="worker_lost",
                )
                submitted_at = as_utc(job.created_at).timestamp()
                enqueue_job(
                    self.celery, job.id, job.tier, {ENQUEUED_AT_HEADER: f"{submitted_at:.6f}"}
                )

    def _publish(self, job_id: str, event_type: str, **fields: Any) -> None:
        try:
            self.publisher.publish(job_id, event_type, **fields)
        except redis.RedisError:
            log.warning("job %s: could not publish its %s event", job_id, event_type)

    def run(self, stopped: threading.Event) -> None:
        """Tick every `scheduler_interval_s` until `stopped` is set; a failed tick is retried."""
        log.info("scheduler running: every %gs", self.settings.scheduler_interval_s)
        while not stopped.is_set():
            try:
                report = self.tick()
                if report.expired or report.requeued or report.failed:
                    log.info(
                        "tick: %d expired, %d requeued, %d failed",
                        len(report.expired),
                        len(report.requeued),
                        len(report.failed),
                    )
            except Exception:
                log.exception("scheduler tick failed; retrying")
            stopped.wait(self.settings.scheduler_interval_s)


def _job_fields(job: Job) -> dict[str, Any]:
    return {"job_id": job.id, "tier": job.tier, "worker": job.worker, "attempt": job.attempt}
