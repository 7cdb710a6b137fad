"""Runs one job: claim it, start an attempt, generate in the engine, record the outcome.

Everything a run touches is handed in (store, engine, Redis, publisher), so unit tests can run
it against a fake engine. Every step is safe to repeat: a redelivered or duplicated task for a
job that is final, cancelled or claimed by a live worker does nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import redis
from sqlalchemy.exc import DBAPIError, OperationalError

from core import keys
from core.events import EventPublisher
from core.jobs import JobOutcome, JobStore
from core.models import Job, as_utc
from core.settings import Settings
from core.states import JobStatus, final_event_type
from core.tiers import engine_priority
from workers.generation import Engine, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)

# Delete a lease only if it is still ours: a lapsed lease may already belong to another worker.
_RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


STORE_RETRIES = 12
"""Attempts to write a result while the database is unreachable (about a minute in all)."""

STATS_TTL_S = 10
"""A worker whose heartbeat stops drops off the live list after this long."""


@dataclass
class WorkerStats:
    """Counters a worker keeps about itself; published to Redis by its heartbeat."""

    in_flight: int = 0
    peak_in_flight: int = 0
    engine_requests: int = 0
    skipped: int = 0
    succeeded: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_mapping(self) -> dict[str | bytes | bytearray | memoryview | int | float, int]:
        """The counters, as written to the worker's stats hash."""
        with self.lock:
            return {
                "in_flight": self.in_flight,
                "peak_in_flight": self.peak_in_flight,
                "engine_requests": self.engine_requests,
                "skipped": self.skipped,
                "succeeded": self.succeeded,
            }


class JobRunner:
    """Takes job ids off the queue and drives them through the engine."""

    def __init__(
        self,
        *,
        settings: Settings,
        store: JobStore,
        engine: Engine,
        redis_client: redis.Redis,
        worker_name: str,
    ) -> None:
        self.settings = settings
        self.store = store
        self.engine = engine
        self.redis = redis_client
        self.worker_name = worker_name
        self.publisher = EventPublisher(redis_client, settings.job_key_ttl_s)
        self.stats = WorkerStats()
        self._release = redis_client.register_script(_RELEASE_SCRIPT)
        # job id → engine request id, for every job this worker is running
        self._running: dict[str, str] = {}

    def run(self, job_id: str) -> JobStatus | None:
        """Run the job if it still needs running; returns its final status, or None if skipped."""
        job = self.store.get(job_id)
        if job is None:
            log.warning("job %s is not in the database; dropping its message", job_id)
            return self._skip()
        if JobStatus(job.status).is_final:
            return self._skip()
        token = f"{self.worker_name}:{time.monotonic_ns()}"
        lease_ms = int(self.settings.lease_ttl_s * 1000)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(keys.job_lease(job_id), token, nx=True, px=lease_ms)
        pipe.exists(keys.job_cancel_flag(job_id))
        claimed, cancel_requested = pipe.execute()
        if not claimed:
            return self._skip()  # a live worker is running it
        try:
            return self._run_claimed(job, bool(cancel_requested))
        finally:
            self._release(keys=[keys.job_lease(job_id)], args=[token])

    def _skip(self) -> JobStatus | None:
        with self.stats.lock:
            self.stats.skipped += 1
        return None

    def _run_claimed(self, job: Job, cancel_requested: bool) -> JobStatus | None:
        job_id = job.id
        if cancel_requested and self.store.cancel_if_queued(job_id):
            self._publish_final(job_id, JobStatus.CANCELLED)
            return JobStatus.CANCELLED
        remaining_s = job.timeout_s - _age_s(job.created_at)
        if remaining_s <= 0 and self.store.expire_if_queued(job_id):
            self._publish_final(job_id, JobStatus.TIMED_OUT, error_code="queue_timeout")
            return JobStatus.TIMED_OUT
        started = self.store.start_attempt(job_id, self.worker_name)
        if started is None:
            return self._skip()

        request = GenerationRequest(
            request_id=f"{job_id}-{started.attempt}",
            prompt=started.prompt,
            sampling=dict(started.sampling_params),
            priority=engine_priority(self.settings.tier_policy(started.tier)),
            timeout_s=max(remaining_s, 0.001),
        )
        with self.stats.lock:
            self.stats.in_flight += 1
            self.stats.engine_requests += 1
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, self.stats.in_flight)
        self._running[job_id] = request.request_id
        log.info(
            "job %s started: attempt %d, tier %s, %d in flight",
            job_id,
            started.attempt,
            started.tier,
            self.stats.in_flight,
        )
        try:
            future = self.engine.submit(request)
            self._announce_start(job_id, request.request_id)
            result = future.result()
        finally:
            self._running.pop(job_id, None)
            with self.stats.lock:
                self.stats.in_flight -= 1
        return self._record(job_id, started.attempt, result)

    def _announce_start(self, job_id: str, request_id: str) -> None:
        """Publish the running event and catch a cancel that came before the job was registered.

        The job is in `_running` already, so a cancel is seen either here or by the listener.
        Both are best effort: the generation goes on if Redis is briefly unreachable.
        """
        try:
            pipe = self.redis.pipeline(transaction=False)
            self.publisher.publish(job_id, "status", status=JobStatus.RUNNING.value, client=pipe)
            pipe.exists(keys.job_cancel_flag(job_id))
            if pipe.execute()[-1]:
                self.engine.cancel(request_id)
        except redis.RedisError:
            log.warning("job %s: could not announce its start", job_id, exc_info=True)

    def _record(self, job_id: str, attempt: int, result: GenerationResult) -> JobStatus | None:
        outcome = JobOutcome(
            status=result.status,
            text=result.text,
            finish_reason=result.finish_reason,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            cached_prompt_tokens=result.cached_prompt_tokens,
            first_token_at=result.first_token_at,
            error_code=result.error_code,
            error_message=result.error_message,
        )
        written = self._store_outcome(job_id, attempt, outcome)
        if written is None:
            log.info("job %s attempt %d was superseded; its result is dropped", job_id, attempt)
            return None
        result.status = written.status
        log.info(
            "job %s %s: %d tokens, finish %s",
            job_id,
            result.status.value,
            result.completion_tokens,
            result.finish_reason,
        )
        if result.status is JobStatus.SUCCEEDED:
            with self.stats.lock:
                self.stats.succeeded += 1
        try:
            self._publish_final(
                job_id,
                result.status,
                finish_reason=result.finish_reason,
                error_code=written.error_code,
            )
        except redis.RedisError:
            # The database has the outcome; readers that missed the event find it there.
            log.warning("job %s: could not publish its final event", job_id, exc_info=True)
        return result.status

    def _store_outcome(self, job_id: str, attempt: int, outcome: JobOutcome) -> JobOutcome | None:
        """Write the outcome, retrying while the database is unreachable.

        A result the database refuses outright is replaced by a `failed` outcome saying so, so
        the job still ends in exactly one final state. None if the attempt was superseded.
        """
        delay_s = 0.2
        for _ in range(STORE_RETRIES):
            try:
                if self.store.finish_attempt(job_id, attempt, outcome):
                    return outcome
                return None
            except DBAPIError as exc:
                if exc.connection_invalidated or isinstance(exc, OperationalError):
                    log.warning("job %s: database unavailable, retrying: %s", job_id, exc)
                    time.sleep(delay_s)
                    delay_s = min(delay_s * 2, 5.0)
                    continue
                log.exception("job %s: the database refused its result", job_id)
                outcome = replace(
                    outcome,
                    status=JobStatus.FAILED,
                    text="",
                    error_code="result_not_stored",
                    error_message=f"The result could not be stored: {type(exc.orig).__name__}.",
                )
        raise RuntimeError(f"job {job_id}: the database stayed unavailable")

    def _publish_final(self, job_id: str, status: JobStatus, **fields: Any) -> None:
        self.publisher.publish(job_id, final_event_type(status), status=status.value, **fields)

    def cancel(self, job_id: str) -> bool:
        """Abort a job this worker is running; False if it is not running here."""
        request_id = self._running.get(job_id)
        return request_id is not None and self.engine.cancel(request_id)

    def renew_leases(self) -> None:
        """Extend the lease of every job in flight here; the heartbeat calls this."""
        lease_ms = int(self.settings.lease_ttl_s * 1000)
        pipe = self.redis.pipeline(transaction=False)
        for job_id in list(self._running):
            pipe.pexpire(keys.job_lease(job_id), lease_ms)
        pipe.hset(keys.worker_stats(self.worker_name), mapping=self.stats.as_mapping())
        pipe.expire(keys.worker_stats(self.worker_name), STATS_TTL_S)
        pipe.execute()

    def retire(self) -> None:
        """Take this worker off the list of live workers."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(keys.worker_stats(self.worker_name))
        pipe.srem(keys.WORKERS_SET, self.worker_name)
        pipe.execute()


def _age_s(created_at: datetime) -> float:
    return (datetime.now(UTC) - as_utc(created_at)).total_seconds()
