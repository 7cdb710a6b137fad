"""Recording how runs ended: the database first, then the final events, in batches.

Jobs that finish together (a batch in the engine usually does) are written in one transaction
and announced in one Redis round trip by a recorder thread, while their Celery threads wait.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import redis
from sqlalchemy.exc import DBAPIError, OperationalError

from core import keys
from core.events import Event, EventPublisher
from core.jobs import JobOutcome, JobStore
from core.logs import job_fields
from core.models import Job, as_utc, utcnow
from core.resultcache import CachedResult
from core.states import JobStatus, ServedFrom, final_event_type
from workers.generation import GenerationResult
from workers.leases import Leases
from workers.metrics import observe_outcome

log = logging.getLogger(__name__)

STORE_RETRIES = 12
"""Attempts to write a result while the database is unreachable (about a minute in all)."""


MAX_BATCH = 256


@dataclass
class _Finished:
    job_id: str
    attempt: int
    outcome: JobOutcome
    lease_token: str
    ticket: Future[JobStatus | None]
    tier: str
    created_at: datetime
    cache_key: str | None
    started_at: datetime | None
    arm: tuple[str, str] | None  # its experiment and variant


def _count_finished(pipe: Any, finished: list[_Finished], lane: str | None) -> None:
    """Count the runs of the worker's `lane` that ended, all together and per tier with their
    run time."""
    bucket = int(time.time()) // keys.RATE_BUCKET_S
    counts: dict[str, int] = defaultdict(int)
    run_ms: dict[str, int] = defaultdict(int)
    now = utcnow()
    for item in finished:
        counts[item.tier] += 1
        if item.started_at is not None:
            run_ms[item.tier] += int((now - as_utc(item.started_at)).total_seconds() * 1000)
    names = [(keys.finished_bucket(bucket, lane), len(finished))]
    for tier, count in counts.items():
        names.append((keys.finished_tier_bucket(tier, bucket, lane), count))
        names.append((keys.run_ms_bucket(tier, bucket, lane), max(run_ms[tier], 0)))
    for name, amount in names:
        pipe.incrby(name, amount)
        pipe.expire(name, keys.RATE_BUCKET_TTL_S)


class OutcomeRecorder:
    """Writes attempts' outcomes, fenced by attempt number, announces them, frees their leases."""

    def __init__(
        self,
        store: JobStore,
        publisher: EventPublisher,
        leases: Leases,
        *,
        before_final: Callable[[list[str]], None] | None = None,
        cache_ttl_s: int = 0,
        lane: str | None = None,
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.leases = leases
        # Called with the ending jobs' ids before their outcomes are stored: publishes the
        # deltas still queued or held back, which precede them.
        self.before_final = before_final
        # A succeeded deterministic job's result answers its repeats this long (0: never).
        self.cache_ttl_s = cache_ttl_s
        # The worker's model's lane (`core.keys.queue_name`): its runs count for that model.
        self.lane = lane
        self._finished: queue.SimpleQueue[_Finished] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="inferq-recorder", daemon=True).start()

    def record(self, job: Job, result: GenerationResult, lease_token: str) -> JobStatus | None:
        """Store and publish the outcome, release the lease; None if the attempt was superseded."""
        return self.record_async(job, result, lease_token).result()

    def record_async(
        self, job: Job, result: GenerationResult, lease_token: str
    ) -> Future[JobStatus | None]:
        """`record` without waiting: the future resolves once the outcome is stored."""
        ticket: Future[JobStatus | None] = Future()
        self._finished.put(
            _Finished(
                job.id,
                job.attempt,
                _outcome(result),
                lease_token,
                ticket,
                job.tier,
                job.created_at,
                job.cache_key,
                job.started_at,
                (job.experiment, job.variant) if job.experiment and job.variant else None,
            )
        )
        return ticket

    def _loop(self) -> None:
        while True:
            batch = [self._finished.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._finished.get_nowait())
                except queue.Empty:
                    break
            try:
                statuses = self._record_batch(batch)
            except Exception as exc:
                log.exception("could not record %d outcomes", len(batch))
                for item in batch:
                    item.ticket.set_exception(exc)
                continue
            for item in batch:
                item.ticket.set_result(statuses.get(item.job_id))

    def _record_batch(self, batch: list[_Finished]) -> dict[str, JobStatus]:
        # Every delta goes out before the outcome is stored: a worker killed in between leaves
        # either a running job (its next attempt continues it) or a final one whose stream is
        # whole, never a final job whose deltas stop short of its text.
        if self.before_final is not None:
            try:
                self.before_final([item.job_id for item in batch])
            except TimeoutError:  # Redis is stuck; the stored result is what counts
                log.warning(
                    "deltas still queued after the timeout; storing %d outcomes", len(batch)
                )
        try:
            ids = self.store.finish_attempts([(i.job_id, i.attempt, i.outcome) for i in batch])
            written = {i.job_id: i.outcome for i in batch if i.job_id in ids}
        except DBAPIError:
            # One refused row, or an outage, fails the whole transaction: go one by one.
            written = {}
            for item in batch:
                outcome = self._store(item.job_id, item.attempt, item.outcome)
                if outcome is not None:
                    written[item.job_id] = outcome
        try:
            pipe = self.publisher.client.pipeline(transaction=False)
            finals = [_final_event(job_id, outcome) for job_id, outcome in written.items()]
            self.publisher.publish_many(finals, client=pipe)
            self._cache_results(pipe, [i for i in batch if i.job_id in written])
            if written:  # the measured capacity and run times that admission control goes by
                _count_finished(pipe, [item for item in batch if item.job_id in written], self.lane)
            self.leases.release([(item.job_id, item.lease_token) for item in batch], pipe)
            pipe.execute()
        except redis.RedisError:
            # The database has the outcomes; readers that missed an event find it there.
            log.warning("could not publish %d final events", len(written), exc_info=True)
        finished_at = utcnow()
        for item in batch:
            outcome = written.get(item.job_id)
            if outcome is None:
                log.info("job %s attempt %d was superseded", item.job_id, item.attempt)
            else:
                observe_outcome(item.tier, item.created_at, outcome, finished_at, item.arm)
                log.info(
                    "job %s %s: %d tokens, finish %s",
                    item.job_id,
                    outcome.status.value,
                    outcome.completion_tokens,
                    outcome.finish_reason,
                    extra=job_fields(item.job_id, item.tier, attempt=item.attempt),
                )
        return {job_id: outcome.status for job_id, outcome in written.items()}

    def _cache_results(self, pipe: redis.client.Pipeline, written: list[_Finished]) -> None:
        """Queue the cache writes of succeeded deterministic jobs on the pipeline."""
        if self.cache_ttl_s <= 0:
            return
        for item in written:
            outcome = item.outcome
            if item.cache_key is None or outcome.status is not JobStatus.SUCCEEDED:
                continue
            if outcome.resumed_tokens:  # two runs' text: not what one run would answer
                continue
            cached = CachedResult(
                outcome.text,
                outcome.finish_reason,
                outcome.prompt_tokens,
                outcome.completion_tokens,
            )
            pipe.set(keys.result_cache(item.cache_key), cached.dumps(), ex=self.cache_ttl_s)

    def publish_final(self, job_id: str, status: JobStatus, **fields: Any) -> None:
        """The job's last event; the database already holds its state, so this is best effort."""
        try:
            self.publisher.publish(job_id, final_event_type(status), status=status.value, **fields)
        except redis.RedisError:
            log.warning("job %s: could not publish its final event", job_id, exc_info=True)

    def _store(self, job_id: str, attempt: int, outcome: JobOutcome) -> JobOutcome | None:
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


def _final_event(job_id: str, outcome: JobOutcome) -> Event:
    return (
        job_id,
        final_event_type(outcome.status),
        {
            "status": outcome.status.value,
            "finish_reason": outcome.finish_reason,
            "error_code": outcome.error_code,
            "usage": {
                "prompt_tokens": outcome.prompt_tokens,
                "completion_tokens": outcome.completion_tokens,
                **({"resumed_tokens": outcome.resumed_tokens} if outcome.resumed_tokens else {}),
            },
        },
    )


def _outcome(result: GenerationResult) -> JobOutcome:
    return JobOutcome(
        status=result.status,
        text=result.text,
        finish_reason=result.finish_reason,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        cached_prompt_tokens=result.cached_prompt_tokens,
        first_token_at=result.first_token_at,
        error_code=result.error_code,
        error_message=result.error_message,
        served_from=ServedFrom.MERGED if result.merged else ServedFrom.ENGINE,
        resumed_tokens=result.resumed_tokens,
    )
