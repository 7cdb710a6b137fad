"""Runs jobs: claim them, start attempts, generate in the engine, record the outcomes.

Celery's threads each hand one job id to `JobRunner.run` and wait. Starting is batched: one
starter thread takes every job waiting to start and claims, checks and starts them together
(one read, one Redis round trip, one UPDATE … RETURNING, one more round trip to announce
them), so a burst of jobs costs a few round trips rather than a few per job.

Every step is safe to repeat: a redelivered or duplicated task for a job that is final,
cancelled or claimed by a live worker does nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime

import redis
from sqlalchemy.exc import OperationalError

from core import keys
from core.events import EventPublisher
from core.jobs import JobStore
from core.logs import job_fields
from core.metrics import IN_FLIGHT, JOBS_MERGED
from core.models import Job, as_utc
from core.settings import Settings
from core.states import JobStatus
from core.tiers import engine_priority
from workers.generation import GenerationRequest, GenerationResult
from workers.merging import MergingEngine
from workers.metrics import observe_ended_unrun, observe_start
from workers.outcomes import OutcomeRecorder
from workers.streams import DeltaPublisher

log = logging.getLogger(__name__)

# Delete a lease only if it is still ours: a lapsed lease may already belong to another worker.
_RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

STATS_TTL_S = 10
"""A worker whose heartbeat stops drops off the live list after this long."""

MAX_START_BATCH = 256
START_RETRY_MAX_DELAY_S = 5.0
_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, OperationalError)
"""Errors of a service that is out for now; starting again later may work."""


@dataclass
class WorkerStats:
    """Counters a worker keeps about itself; published to Redis by its heartbeat."""

    in_flight: int = 0
    peak_in_flight: int = 0
    engine_requests: int = 0
    merged: int = 0
    skipped: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_mapping(self) -> dict[str | bytes | bytearray | memoryview | int | float, int]:
        """The counters, as written to the worker's stats hash."""
        with self.lock:
            return {
                "in_flight": self.in_flight,
                "peak_in_flight": self.peak_in_flight,
                "engine_requests": self.engine_requests,
                "merged": self.merged,
                "skipped": self.skipped,
            }


@dataclass
class _Started:
    """A job the starter put into the engine."""

    job: Job
    token: str
    generation: Future[GenerationResult]


# What the starter answers for one job: started, ended without the engine, or skipped (None).
_StartOutcome = _Started | JobStatus | None


class JobRunner:
    """Takes job ids off the queue and drives them through the engine."""

    def __init__(
        self,
        *,
        settings: Settings,
        store: JobStore,
        engine: MergingEngine,
        redis_client: redis.Redis,
        worker_name: str,
        deltas: DeltaPublisher | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.engine = engine
        self.redis = redis_client
        self.worker_name = worker_name
        self.publisher = EventPublisher(redis_client, settings.job_key_ttl_s)
        self.stats = WorkerStats()
        self._release = redis_client.register_script(_RELEASE_SCRIPT)
        self.deltas = deltas
        self.outcomes = OutcomeRecorder(
            store,
            self.publisher,
            self._release,
            before_final=deltas.flush if deltas else None,
            cache_ttl_s=settings.result_cache_ttl_s,
        )
        # job id → engine request id, for every job this worker is running
        self._running: dict[str, str] = {}
        self._to_start: queue.SimpleQueue[tuple[str, Future[_StartOutcome]]] = queue.SimpleQueue()
        self._starter = threading.Thread(
            target=self._start_loop, name="inferq-starter", daemon=True
        )
        self._starter.start()

    def run(self, job_id: str) -> JobStatus | None:
        """Run the job if it still needs running; returns its final status, or None if skipped."""
        started = self._start(job_id)
        if not isinstance(started, _Started):
            return started
        job = started.job
        request_id = self._running[job.id]
        try:
            result = started.generation.result()
        finally:
            # A later attempt of the same job may have started here meanwhile: leave it be.
            if self._running.get(job.id) == request_id:
                del self._running[job.id]
            with self.stats.lock:
                self.stats.in_flight -= 1
        return self.outcomes.record(job, result, started.token)

    def _start(self, job_id: str) -> _StartOutcome:
        """Hand the job to the starter; while Redis or the database is out, try again.

        The message stays unacknowledged meanwhile, so the job is neither lost nor run twice.
        """
        delay_s = 0.2
        while True:
            ticket: Future[_StartOutcome] = Future()
            self._to_start.put((job_id, ticket))
            try:
                return ticket.result()
            except _UNAVAILABLE as exc:
                log.warning("job %s: could not start, retrying in %.1fs: %s", job_id, delay_s, exc)
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, START_RETRY_MAX_DELAY_S)

    def _start_loop(self) -> None:
        while True:
            batch = [self._to_start.get()]
            while len(batch) < MAX_START_BATCH:
                try:
                    batch.append(self._to_start.get_nowait())
                except queue.Empty:
                    break
            try:
                answers = self._start_batch([job_id for job_id, _ in batch])
            except Exception as exc:  # every job of the batch hears about it
                if isinstance(exc, _UNAVAILABLE):
                    log.warning("could not start a batch of %d jobs: %s", len(batch), exc)
                else:
                    log.exception("could not start a batch of %d jobs", len(batch))
                for _, ticket in batch:
                    ticket.set_exception(exc)
                continue
            for job_id, ticket in batch:
                # A duplicate message in the same batch is skipped: only the first one runs.
                ticket.set_result(answers.pop(job_id, None))

    def _start_batch(self, job_ids: list[str]) -> dict[str, _StartOutcome]:
        """Claim, check and start the given jobs; the answer for each id (absent: skipped)."""
        ids = list(dict.fromkeys(job_ids))  # a duplicate in one batch is skipped like any other
        jobs = self.store.get_many(ids)
        for job_id in set(ids) - set(jobs):
            log.warning("job %s is not in the database; dropping its message", job_id)
        live = [i for i in ids if i in jobs and not JobStatus(jobs[i].status).is_final]
        answers: dict[str, _StartOutcome] = {}
        tokens = {job_id: f"{self.worker_name}:{time.monotonic_ns()}" for job_id in live}
        lease_ms = int(self.settings.lease_ttl_s * 1000)
        pipe = self.redis.pipeline(transaction=False)
        for job_id in live:
            pipe.set(keys.job_lease(job_id), tokens[job_id], nx=True, px=lease_ms)
            pipe.exists(keys.job_cancel_flag(job_id))
        replies = pipe.execute()
        # Claimed here (a live worker holds the others), and whether a cancel was asked for.
        claimed = {
            job_id: bool(replies[2 * index + 1])
            for index, job_id in enumerate(live)
            if replies[2 * index]
        }
        try:
            started = self._start_claimed(jobs, claimed, answers)
        except Exception:
            # Nothing started: free the leases, or a retry would find the jobs "running".
            for job_id in claimed:
                self._release_lease(job_id, tokens[job_id])
            raise
        for job in started.values():
            observe_start(job.tier, job.created_at, job.started_at or job.created_at)
        for job_id in claimed:
            if job_id not in started:  # ended without the engine, or meanwhile
                self._release_lease(job_id, tokens[job_id])
        # Announced before they are submitted, so a job's running event precedes its deltas.
        self._announce_starts(list(started.values()))
        for job in started.values():
            answers[job.id] = _Started(job, tokens[job.id], self._submit(job))
        self._catch_early_flags(list(started))
        with self.stats.lock:
            self.stats.skipped += len(ids) - len(answers) + (len(job_ids) - len(ids))
        return answers

    def _start_claimed(
        self, jobs: dict[str, Job], claimed: dict[str, bool], answers: dict[str, _StartOutcome]
    ) -> dict[str, Job]:
        """End the claimed jobs that must not run (into `answers`); start the others."""
        to_start = []
        for job_id, cancel_requested in claimed.items():
            ended = self._end_without_engine(jobs[job_id], cancel_requested)
            if ended is not None:
                answers[job_id] = ended
            else:
                to_start.append(job_id)
        return {job.id: job for job in self.store.start_attempts(to_start, self.worker_name)}

    def _end_without_engine(self, job: Job, cancel_requested: bool) -> JobStatus | None:
        """Cancel or expire a claimed job that must not run; None if it should start."""
        if cancel_requested and self.store.cancel_if_queued(job.id):
            observe_ended_unrun(job.tier, JobStatus.CANCELLED)
            self.outcomes.publish_final(job.id, JobStatus.CANCELLED)
            return JobStatus.CANCELLED
        if _queue_expired(job) and self.store.expire_if_queued(job.id):
            observe_ended_unrun(job.tier, JobStatus.TIMED_OUT)
            self.outcomes.publish_final(job.id, JobStatus.TIMED_OUT, error_code="queue_timeout")
            return JobStatus.TIMED_OUT
        return None

    def _submit(self, job: Job) -> Future[GenerationResult]:
        request = GenerationRequest(
            request_id=f"{job.id}-{job.attempt}",
            prompt=job.prompt,
            sampling=dict(job.sampling_params),
            priority=engine_priority(self.settings.tier_policy(job.tier)),
            timeout_s=max(_remaining_s(job), 0.001),
            job_id=job.id,
            attempt=job.attempt,
        )
        self._running[job.id] = request.request_id
        generation, merged = self.engine.submit_merging(request)
        with self.stats.lock:
            self.stats.in_flight += 1
            self.stats.engine_requests += 0 if merged else 1
            self.stats.merged += 1 if merged else 0
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, self.stats.in_flight)
        if merged:
            JOBS_MERGED.labels(job.tier).inc()
        log.info(
            "job %s started: attempt %d, tier %s%s",
            job.id,
            job.attempt,
            job.tier,
            ", merged with an identical job" if merged else "",
            extra=job_fields(job.id, job.tier, attempt=job.attempt),
        )
        return generation

    def _announce_starts(self, jobs: list[Job]) -> None:
        """Queue the running events on the delta channel, ahead of any delta of these runs."""
        if not jobs:
            return
        events = [
            (job.id, "status", {"status": JobStatus.RUNNING.value, "attempt": job.attempt})
            for job in jobs
        ]
        if self.deltas is not None:
            self.deltas.publish_events(events)
            return
        try:
            self.publisher.publish_many(events)
        except redis.RedisError:  # best effort: the runs go on
            log.warning("could not announce %d job starts", len(jobs), exc_info=True)

    def _catch_early_flags(self, job_ids: list[str]) -> None:
        """Abort jobs whose cancel, and watch jobs whose reader, came before they ran here.

        The jobs are in `_running` and the engine already, so every cancel or watch is seen
        either here or by the control listener. Best effort: a Redis outage leaves them running,
        their deltas held until they end.
        """
        if not job_ids:
            return
        try:
            pipe = self.redis.pipeline(transaction=False)
            for job_id in job_ids:
                pipe.exists(keys.job_cancel_flag(job_id))
                pipe.exists(keys.job_watched(job_id))
            flags = pipe.execute()
        except redis.RedisError:
            log.warning(
                "could not check %d jobs for cancels and readers", len(job_ids), exc_info=True
            )
            return
        for index, job_id in enumerate(job_ids):
            if flags[2 * index]:
                self.cancel(job_id)
            if flags[2 * index + 1]:
                self.watch(job_id)

    def _release_lease(self, job_id: str, token: str) -> None:
        try:
            self._release(keys=[keys.job_lease(job_id)], args=[token])
        except redis.RedisError:  # it lapses by itself
            log.warning("job %s: could not release its lease", job_id, exc_info=True)

    def watch(self, job_id: str) -> None:
        """Publish the job's deltas live from now on, if it runs here (a reader follows it)."""
        if self.deltas is not None:
            self.deltas.watch(job_id)

    def cancel(self, job_id: str) -> bool:
        """Abort a job this worker is running; False if it is not running here."""
        request_id = self._running.get(job_id)
        return request_id is not None and self.engine.cancel(request_id)

    def renew_leases(self) -> None:
        """Extend the lease of every job in flight here, and publish this worker's counters.

        The heartbeat calls this every second; it also watches running jobs that have pub/sub
        subscribers, so their deltas go out live.
        """
        lease_ms = int(self.settings.lease_ttl_s * 1000)
        running = list(self._running)
        pipe = self.redis.pipeline(transaction=False)
        for job_id in running:
            pipe.pexpire(keys.job_lease(job_id), lease_ms)
        counters = self.stats.as_mapping()
        IN_FLIGHT.labels(self.worker_name).set(counters["in_flight"])
        pipe.hset(keys.worker_stats(self.worker_name), mapping=counters)
        pipe.expire(keys.worker_stats(self.worker_name), STATS_TTL_S)
        pipe.sadd(keys.WORKERS_SET, self.worker_name)
        if running and self.deltas is not None:
            # Readers subscribed to a job's channel straight on Redis watch it too.
            pipe.pubsub_numsub(*(keys.job_events_channel(job_id) for job_id in running))
        replies = pipe.execute()
        if running and self.deltas is not None:
            for job_id, (_channel, subscribers) in zip(running, replies[-1], strict=True):
                if subscribers:
                    self.deltas.watch(job_id)

    def retire(self) -> None:
        """Take this worker off the list of live workers.

        Its name stays in the workers set, so the dispatcher hands whatever is left in (or
        comes back to) its own queues over to the shared ones.
        """
        self.redis.delete(keys.worker_stats(self.worker_name))


def _queue_expired(job: Job) -> bool:
    """Whether the job waited past its queue deadline (or its total deadline)."""
    if job.queue_deadline_at is not None and as_utc(job.queue_deadline_at) <= datetime.now(UTC):
        return True
    return _remaining_s(job) <= 0


def _remaining_s(job: Job) -> float:
    """Seconds left before the job's deadline (negative once it has passed)."""
    return job.timeout_s - (datetime.now(UTC) - as_utc(job.created_at)).total_seconds()
