"""`inferq scheduler`: the periodic work no single worker can be trusted with.

Each tick:
- ends every queued job whose queue deadline has passed (`timed_out`, `queue_timeout`), so an
  expired job never reaches an engine even when no worker is free to look at it;
- finds running jobs whose worker is gone and puts them back in their tier's queue for the next
  attempt — or, after `max_attempts`, ends them `failed` with `worker_lost`. A worker is gone
  when its name's claim no longer holds the token its job leases were taken with (the process
  died or stalled: the claim lapses `worker_name_ttl_s` after its last renewal, 5 s by
  default, and is still missing `CLAIM_MISSING_S` later), or, failing that, when a job's
  lease has lapsed (`lease_ttl_s`);
- puts back in their queues the messages of queued jobs that a worker took and never started
  (it died or froze right after taking them: `core.queue.unstarted`), as soon as its running
  jobs would be handed on;
- notices when Redis has lost its data (restarted without persistence, failed over to an empty
  replica, flushed) by the absence of a mark that never expires, and sends every queued job's
  message again: the database, not Redis, is the record of which jobs wait. A job whose message
  survived after all gets two, and workers skip the second.

Every change is a conditional UPDATE fenced by status and attempt, so several schedulers, or a
scheduler racing a worker that comes back, never move a job twice.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import redis
from celery import Celery
from sqlalchemy.exc import OperationalError

from core import keys
from core.events import EventPublisher
from core.health import Health
from core.jobs import JobStore
from core.metrics import JOBS_FINISHED, JOBS_REQUEUED
from core.models import Job, as_utc, utcnow
from core.queue.app import ENQUEUED_AT_HEADER, enqueue_jobs
from core.queue.unstarted import UnstartedJobs
from core.settings import Settings
from core.states import JobStatus
from core.workernames import lease_holder

log = logging.getLogger(__name__)

CLAIM_MISSING_S = 2.5
"""How long a worker's name claim must stay missing before its jobs are handed on: longer
than a live worker takes to set it again (its next renewal, every 1.7 s by default) when Redis
let it lapse — starved of CPU past the claim's TTL, or failed over without it."""

LEASES_PER_READ = 1000
"""Leases read by one MGET: a longer reply would hold Redis from every other client."""

# KEYS[1]: a job's lease; ARGV[1]: the value it was read with. Deleted only if still that value.
_DROP_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass
class TickReport:
    """What one tick changed."""

    expired: list[str] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)
    unstarted: list[str] = field(default_factory=list)
    """Queued jobs whose messages a worker took and never started, put back in their queues."""
    failed: list[str] = field(default_factory=list)
    resent: int = 0


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
        self._drop_lease = client.register_script(_DROP_LEASE)
        self._missing_since: dict[str, float] = {}  # worker → when its claim was first missed
        # A message is taken for abandoned when a lost worker's running jobs would be handed on.
        self.unstarted = UnstartedJobs(
            client, store, after_s=settings.worker_name_ttl_s + CLAIM_MISSING_S
        )

    def tick(self) -> TickReport:
        """Do one round of periodic work."""
        report = TickReport()
        report.resent = self._resend_if_redis_lost_data()
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
        self._reap(now, report)
        report.unstarted = self.unstarted.hand_on()
        JOBS_REQUEUED.inc(len(report.unstarted))
        return report

    def _resend_if_redis_lost_data(self) -> int:
        """Send every queued job's message again if Redis came back empty; how many were sent.

        The mark is set only once every message is out, so a scheduler that dies halfway
        leaves the whole resend to the next tick or the next scheduler.
        """
        if self.redis.exists(keys.DATA_MARK):
            return 0
        queued = self.store.queued()
        if queued:
            log.warning("Redis has lost its data: sending the %d queued jobs again", len(queued))
            enqueue_jobs(
                self.celery,
                [(job_id, tier) for job_id, tier, _, _ in queued],
                [
                    {ENQUEUED_AT_HEADER: f"{as_utc(created_at).timestamp():.6f}"}
                    for _, _, created_at, _ in queued
                ],
                [
                    keys.queue_name(tier, self.settings.lane_of(model))
                    for _, tier, _, model in queued
                ],
            )
        self.redis.set(keys.DATA_MARK, utcnow().isoformat())
        return len(queued)

    def _reap(self, now: datetime, report: TickReport) -> None:
        candidates = self.store.running()
        if not candidates:
            self._missing_since.clear()
            return
        workers = sorted({job.worker for job in candidates if job.worker})
        # Every tick reads every running job's lease: one MGET per thousand, not a GET each.
        pipe = self.redis.pipeline(transaction=False)
        for first in range(0, len(candidates), LEASES_PER_READ):
            chunk = candidates[first : first + LEASES_PER_READ]
            pipe.mget([keys.job_lease(job.id) for job in chunk])
        if workers:
            pipe.mget([keys.worker_name_claim(worker) for worker in workers])
        replies = pipe.execute()
        claim_values = replies.pop() if workers else []
        leases = [lease for read in replies for lease in read]
        claims = dict(zip(workers, claim_values, strict=True))
        lost = self._lost_workers(claims)
        lapsed_before = now - timedelta(seconds=self.settings.lease_ttl_s)
        for job, lease in zip(candidates, leases, strict=True):
            if lease is None:
                if job.started_at is not None and as_utc(job.started_at) >= lapsed_before:
                    continue  # the worker may be about to record its end
                how = "its lease lapsed"
            elif self._holder_gone(job, lease, claims.get(job.worker or ""), lost):
                how = "its worker no longer holds its name"
            else:
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
                    "job %s: worker %s lost it in attempt %d (%s); requeued",
                    job.id,
                    job.worker,
                    job.attempt,
                    how,
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
                enqueue_jobs(
                    self.celery,
                    [(job.id, job.tier)],
                    [{ENQUEUED_AT_HEADER: f"{submitted_at:.6f}"}],
                    [keys.queue_name(job.tier, self.settings.lane_of(job.model))],
                )

    def _lost_workers(self, claims: dict[str, bytes | None]) -> set[str]:
        """The workers whose name's claim has been missing for `CLAIM_MISSING_S` or longer.

        A claim missed once may be back at its worker's next renewal: Redis was starved of CPU
        or failed over while the claim's TTL ran out, and the live worker takes it again.
        """
        now = time.monotonic()
        self._missing_since = {
            worker: self._missing_since.get(worker, now)
            for worker, claim in claims.items()
            if claim is None
        }
        return {w for w, since in self._missing_since.items() if now - since >= CLAIM_MISSING_S}

    def _holder_gone(self, job: Job, lease: bytes, claim: bytes | None, lost: set[str]) -> bool:
        """Whether the process that took the job's lease no longer holds its worker name (its
        claim has been missing long enough, or another process holds it); if so, the lease is
        deleted (unless it changed meanwhile), so the next worker can claim it."""
        if job.worker is None:
            return False
        if claim is None and job.worker not in lost:
            return False
        if claim is not None and lease_holder(lease) == claim.decode():
            return False
        return bool(self._drop_lease(keys=[keys.job_lease(job.id)], args=[lease]))

    def _publish(self, job_id: str, event_type: str, **fields: Any) -> None:
        try:
            self.publisher.publish(job_id, event_type, **fields)
        except redis.RedisError:
            log.warning("job %s: could not publish its %s event", job_id, event_type)

    def run(self, stopped: threading.Event, health: Health | None = None) -> None:
        """Tick every `scheduler_interval_s` until `stopped` is set; a failed tick is retried.

        `health` is ready while the last tick succeeded.
        """
        log.info("scheduler running: every %gs", self.settings.scheduler_interval_s)
        health = health or Health()
        while not stopped.is_set():
            health.beat()
            try:
                report = self.tick()
                health.set_ready(True)
                if any(vars(report).values()):
                    log.info(
                        "tick: %d expired, %d requeued, %d unstarted put back, %d failed, "
                        "%d resent",
                        len(report.expired),
                        len(report.requeued),
                        len(report.unstarted),
                        len(report.failed),
                        report.resent,
                    )
            except (redis.RedisError, OperationalError) as exc:
                health.set_ready(False)
                log.warning("scheduler tick failed, a service is unavailable; retrying: %s", exc)
            except Exception:
                health.set_ready(False)
                log.exception("scheduler tick failed; retrying")
            stopped.wait(self.settings.scheduler_interval_s)


def _job_fields(job: Job) -> dict[str, Any]:
    return {"job_id": job.id, "tier": job.tier, "worker": job.worker, "attempt": job.attempt}
