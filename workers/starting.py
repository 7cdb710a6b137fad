"""Starting jobs in batches: `JobStarter` claims the runner's jobs and puts them in the engine.

One starter thread takes every job waiting to start and claims, checks and starts them together
(one read, one Redis round trip, one UPDATE … RETURNING, one more round trip to announce them),
so a burst of jobs costs a few round trips rather than a few per job.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from sqlalchemy.exc import OperationalError

from core import keys
from core.adapters import Adapter, AdapterStore
from core.events import Event, EventPublisher
from core.jobs import JobStore
from core.logs import job_fields
from core.metrics import JOBS_MERGED
from core.models import Job, as_utc
from core.prompts import StoredPrefixes
from core.settings import Settings
from core.states import JobStatus
from core.tiers import Tier, engine_priority
from core.workernames import lease_token
from workers.adapters import JobAdapters, Refusal
from workers.generation import GenerationRequest, GenerationResult
from workers.leases import Leases, StaleLeases
from workers.merging import MergingEngine
from workers.metrics import WorkerStats, observe_ended_unrun, observe_start
from workers.outcomes import OutcomeRecorder
from workers.reserve import EngineRun, TierReserve
from workers.resume import Resume, joined_when_done, read_resumes
from workers.running import RunningJobs
from workers.streams import DeltaPublisher

log = logging.getLogger(__name__)

MAX_START_BATCH = 256
UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, OperationalError)
"""Errors of a service that is out for now; starting again later may work."""


@dataclass
class Started:
    """A job the starter put into the engine."""

    job: Job
    token: str
    request_id: str
    generation: Future[GenerationResult]


# What the starter answers for one job: started, ended without the engine, or skipped (None).
StartOutcome = Started | JobStatus | None


class JobStarter:
    """Claims, checks and starts jobs in batches, on a thread of its own (see the module doc).

    `JobRunner` makes it with the state the two share: the jobs running here, the KV tokens the
    tier reserve counts for them, and the leases still to release; `cancel` and `watch` are the
    runner's, for a cancel or a reader that came before its job started here.
    """

    def __init__(
        self,
        *,
        settings: Settings,
        store: JobStore,
        engine: MergingEngine,
        redis_client: redis.Redis,
        worker_name: str,
        claim_token: str,
        publisher: EventPublisher,
        stats: WorkerStats,
        leases: Leases,
        outcomes: OutcomeRecorder,
        running: RunningJobs,
        stale_leases: StaleLeases,
        kv_held: dict[str, EngineRun],
        cancel: Callable[[str], bool],
        watch: Callable[[str], None],
        deltas: DeltaPublisher | None = None,
        reserve: TierReserve | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.engine = engine
        self.redis = redis_client
        self.worker_name = worker_name
        self.claim_token = claim_token
        self.publisher = publisher
        self.stats = stats
        self.leases = leases
        self.outcomes = outcomes
        self.deltas = deltas
        self.reserve = reserve
        self._running = running
        self._stale_leases = stale_leases
        self._kv_held = kv_held
        self._cancel = cancel
        self._watch = watch
        self._prefixes = StoredPrefixes(store.db)
        # Its model's lane (`core.keys.queue_name`), which its starts count under.
        self._lane = settings.lane_of(settings.model_name)
        self._adapters = JobAdapters(
            AdapterStore(store.db), settings.model_name, settings.lora, set(settings.models)
        )
        self._to_start: queue.SimpleQueue[tuple[str, Future[StartOutcome]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._start_loop, name="inferq-starter", daemon=True)
        self._thread.start()

    def start(self, job_id: str) -> Future[StartOutcome]:
        """Start the job with the next batch; the answer comes in the future."""
        ticket: Future[StartOutcome] = Future()
        self._to_start.put((job_id, ticket))
        return ticket

    def _start_loop(self) -> None:
        while True:
            batch = [self._to_start.get()]
            while len(batch) < MAX_START_BATCH:
                try:
                    batch.append(self._to_start.get_nowait())
                except queue.Empty:
                    break
            try:
                answers = self.start_batch([job_id for job_id, _ in batch])
            except Exception as exc:  # every job of the batch hears about it
                if isinstance(exc, UNAVAILABLE):
                    log.warning("could not start a batch of %d jobs: %s", len(batch), exc)
                else:
                    log.exception("could not start a batch of %d jobs", len(batch))
                for _, ticket in batch:
                    ticket.set_exception(exc)
                continue
            for job_id, ticket in batch:
                # A duplicate message in the same batch is skipped: only the first one runs.
                ticket.set_result(answers.pop(job_id, None))

    def start_batch(self, job_ids: list[str]) -> dict[str, StartOutcome]:
        """Claim, check and start the given jobs now, on this thread; the answer for each id
        (absent: skipped). The starter's thread calls it for each batch."""
        ids = list(dict.fromkeys(job_ids))  # a duplicate in one batch is skipped like any other
        jobs = self.store.get_many(ids)
        for job_id in set(ids) - set(jobs):
            log.warning("job %s is not in the database; dropping its message", job_id)
        live = [i for i in ids if i in jobs and not JobStatus(jobs[i].status).is_final]
        answers: dict[str, StartOutcome] = {}
        # Each lease names this process's claim on its worker name: the scheduler takes the job
        # for lost as soon as the claim lapses, without waiting for the lease to (core.workernames).
        tokens = {job_id: lease_token(self.claim_token) for job_id in live}
        stale = self._stale_leases.take(live)
        try:
            if stale:
                self.leases.release(stale, self.redis)
            # Claimed here (a live worker holds the others), and whether a cancel was asked for.
            claimed = self.leases.claimed(live, self.leases.claim(tokens, self.redis))
        except redis.RedisError:
            # Redis may have set some leases before the reply was lost: were they kept, the
            # retry would take this worker's own lease for another's and skip the jobs.
            for job_id, token in stale:
                self._stale_leases.add(job_id, [token])
            for job_id in live:
                self._stale_leases.add(job_id, [tokens[job_id]])
            raise
        try:
            adapters, refused = self._adapters.resolve(jobs[job_id] for job_id in claimed)
            started = self._start_claimed(jobs, claimed, answers, refused)
            prompts = self._prefixes.prompts(list(started.values()))
        except Exception:
            # Nothing started: free the leases, or a retry would find the jobs "running".
            for job_id in claimed:
                self._release_lease(job_id, tokens[job_id])
            raise
        for job in started.values():
            observe_start(job.tier, job.created_at, job.started_at or job.created_at)
        try:
            resumes = read_resumes(self.redis, list(started.values()))
        except redis.RedisError:  # what was streamed cannot be read: those runs start afresh
            log.warning("could not read the streams of resumed jobs", exc_info=True)
            resumes = {}
        for job_id in claimed:
            if job_id not in started:  # ended without the engine, or meanwhile
                self._release_lease(job_id, tokens[job_id])
        # Announced before they are submitted, so a job's running event precedes its deltas.
        self._announce_starts(list(started.values()), resumes)
        self._count_starts(list(started.values()))
        submitted = []
        for job in started.values():
            try:
                generation = self._submit(
                    job, prompts[job.id], resumes.get(job.id), adapters.get(job.id)
                )
            except Exception:  # not in the engine: its lease goes, and the reaper hands it on
                log.exception("job %s: the engine did not take it", job.id)
                self._running.end(job.id, _request_id(job))
                self._release_lease(job.id, tokens[job.id])
                continue
            answers[job.id] = Started(job, tokens[job.id], _request_id(job), generation)
            submitted.append(job.id)
        self._catch_early_flags(submitted)
        with self.stats.lock:
            self.stats.skipped += len(ids) - len(answers) + (len(job_ids) - len(ids))
        return answers

    def _start_claimed(
        self,
        jobs: dict[str, Job],
        claimed: dict[str, bool],
        answers: dict[str, StartOutcome],
        refused: dict[str, Refusal],
    ) -> dict[str, Job]:
        """End the claimed jobs that must not run (into `answers`); start the others."""
        to_start = []
        for job_id, cancel_requested in claimed.items():
            ended = self._end_without_engine(jobs[job_id], cancel_requested, refused.get(job_id))
            if ended is not None:
                answers[job_id] = ended
            else:
                to_start.append(job_id)
        attempts = {job_id: jobs[job_id].attempt for job_id in to_start}
        return {job.id: job for job in self.store.start_attempts(attempts, self.worker_name)}

    def _end_without_engine(
        self, job: Job, cancel_requested: bool, refusal: Refusal | None
    ) -> JobStatus | None:
        """Cancel, expire or fail a claimed job that must not run; None if it should start."""
        if cancel_requested and self.store.cancel_if_queued(job.id):
            observe_ended_unrun(job.tier, JobStatus.CANCELLED)
            self.outcomes.publish_final(job.id, JobStatus.CANCELLED)
            return JobStatus.CANCELLED
        if _queue_expired(job) and self.store.expire_if_queued(job.id):
            observe_ended_unrun(job.tier, JobStatus.TIMED_OUT)
            self.outcomes.publish_final(job.id, JobStatus.TIMED_OUT, error_code="queue_timeout")
            return JobStatus.TIMED_OUT
        if refusal is not None and self.store.fail_if_queued(job.id, **vars(refusal)):
            log.warning("job %s cannot run here: %s", job.id, refusal.message)
            observe_ended_unrun(job.tier, JobStatus.FAILED)
            self.outcomes.publish_final(job.id, JobStatus.FAILED, error_code=refusal.error_code)
            return JobStatus.FAILED
        return None

    def _submit(
        self, job: Job, prompt: str, resume: Resume | None, adapter: Adapter | None
    ) -> Future[GenerationResult]:
        request = GenerationRequest(
            request_id=_request_id(job),
            prompt=prompt if resume is None else resume.prompt(prompt),
            sampling=dict(job.sampling_params) if resume is None else resume.sampling(job),
            priority=engine_priority(self.settings.tier_policy(job.tier)),
            timeout_s=max(_remaining_s(job), 0.001),
            job_id=job.id,
            attempt=job.attempt,
            adapter=adapter,
            # A continuation's prompt has the streamed text too: tokenized whole, as before.
            shared_prefix=self._prefixes.text(job) if resume is None else "",
            prompt_tokens=job.prompt_tokens if resume is None else None,
        )
        self._running.add(job.id, request.request_id)
        generation, merged = self.engine.submit_merging(request)
        with self.stats.lock:
            self.stats.in_flight += 1
            self.stats.engine_requests += 0 if merged else 1
            self.stats.merged += 1 if merged else 0
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, self.stats.in_flight)
        if merged:
            JOBS_MERGED.labels(job.tier).inc()
        elif self.reserve is not None:  # a merged job holds no KV cache of its own
            max_tokens = int(request.sampling.get("max_tokens") or 0)
            run = EngineRun(
                job_id=job.id,
                attempt=job.attempt,
                tier=Tier(job.tier),
                tokens=(job.prompt_tokens or 0) + max_tokens,
                max_tokens=max_tokens,
                timeout_s=request.timeout_s,
                # The prefix a batch's prompts share sits once in vLLM's prefix cache.
                shared=self._prefixes.shared(job),
            )
            self._kv_held[request.request_id] = run
            self.reserve.job_started(run)
        log.info(
            "job %s started: attempt %d, tier %s%s%s",
            job.id,
            job.attempt,
            job.tier,
            ", merged with an identical job" if merged else "",
            f", continuing {resume.tokens} streamed tokens" if resume else "",
            extra=job_fields(job.id, job.tier, attempt=job.attempt),
        )
        return generation if resume is None else joined_when_done(generation, job, resume)

    def _announce_starts(self, jobs: list[Job], resumes: dict[str, Resume]) -> None:
        """Queue the running events on the delta channel, ahead of any delta of these runs."""
        if not jobs:
            return
        events: list[Event] = []
        for job in jobs:
            fields: dict[str, Any] = {"status": JobStatus.RUNNING.value, "attempt": job.attempt}
            resume = resumes.get(job.id)
            if resume is not None:
                fields["resumes_after"] = resume.after_seq
            events.append((job.id, "status", fields))
        if self.deltas is not None:
            self.deltas.publish_events(events)
            return
        try:
            self.publisher.publish_many(events)
        except redis.RedisError:  # best effort: the runs go on
            log.warning("could not announce %d job starts", len(jobs), exc_info=True)

    def _count_starts(self, jobs: list[Job]) -> None:
        """Count the started jobs per tier of the worker's lane: the rate each tier's queue
        of its model drains at, which admission control goes by. Best effort: a lost count
        only makes admission guess."""
        if not jobs:
            return
        bucket = int(time.time()) // keys.RATE_BUCKET_S
        per_tier = Counter(job.tier for job in jobs)
        try:
            pipe = self.redis.pipeline(transaction=False)
            for tier, count in per_tier.items():
                name = keys.started_tier_bucket(tier, bucket, self._lane)
                pipe.incrby(name, count)
                pipe.expire(name, keys.RATE_BUCKET_TTL_S)
            pipe.execute()
        except redis.RedisError:
            log.warning("could not count %d job starts", len(jobs), exc_info=True)

    def _catch_early_flags(self, job_ids: list[str]) -> None:
        """Abort jobs whose cancel, and watch jobs whose reader, came before they ran here.

        The jobs are in `_running` and the engine already, so every cancel or watch is seen
        either here or by the control listener. Best effort: a Redis outage leaves them running,
        their deltas held until they end.
        """
        if not job_ids:
            return
        try:
            flags = self.redis.mget(
                [key for i in job_ids for key in (keys.job_cancel_flag(i), keys.job_watched(i))]
            )
        except redis.RedisError:
            log.warning(
                "could not check %d jobs for cancels and readers", len(job_ids), exc_info=True
            )
            return
        for index, job_id in enumerate(job_ids):
            if flags[2 * index] is not None:
                self._cancel(job_id)
            if flags[2 * index + 1] is not None:
                self._watch(job_id)

    def _release_lease(self, job_id: str, token: str) -> None:
        try:
            self.leases.release([(job_id, token)], self.redis)
        except redis.RedisError:  # it lapses by itself, or goes before the job's next claim
            log.warning("job %s: could not release its lease", job_id, exc_info=True)
            self._stale_leases.add(job_id, [token])


def _queue_expired(job: Job) -> bool:
    """Whether the job waited past its queue deadline (or its total deadline)."""
    if job.queue_deadline_at is not None and as_utc(job.queue_deadline_at) <= datetime.now(UTC):
        return True
    return _remaining_s(job) <= 0


def _remaining_s(job: Job) -> float:
    """Seconds left before the job's deadline (negative once it has passed)."""
    return job.timeout_s - (datetime.now(UTC) - as_utc(job.created_at)).total_seconds()


def _request_id(job: Job) -> str:
    """The engine request id of the job's current attempt."""
    return f"{job.id}-{job.attempt}"
