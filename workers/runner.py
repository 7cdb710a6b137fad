"""Runs jobs: claim them, start attempts, generate in the engine, record the outcomes.

The worker's consumer hands each job id to `JobRunner.submit` and goes on: no thread waits
for a job. Starting is batched (`workers.starting.JobStarter`); when the engine ends a run,
the outcome goes to the recorder (see `workers.outcomes`), and when it is stored, the job's
callback acknowledges its message. A job in flight costs no thread, only its place in the
engine.

Every step is safe to repeat: a redelivered or duplicated task for a job that is final,
cancelled or claimed by a live worker does nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from functools import partial

import redis

from core import keys
from core.events import EventPublisher
from core.jobs import JobStore
from core.metrics import HELD_FOR_PACE, IN_FLIGHT, TIME_PER_TOKEN
from core.settings import Settings
from core.states import JobStatus
from core.tiers import TIERS_BY_PRIORITY, Tier
from core.workerinfo import Serving
from workers.generation import GenerationResult
from workers.leases import Leases, StaleLeases
from workers.merging import MergingEngine
from workers.metrics import WorkerStats
from workers.outcomes import OutcomeRecorder
from workers.pace import DeadlinePace
from workers.reserve import EngineRun, TierReserve
from workers.running import RunningJobs
from workers.starting import UNAVAILABLE, JobStarter, Started, StartOutcome
from workers.streams import DeltaPublisher

log = logging.getLogger(__name__)

STATS_TTL_S = 10
"""A worker whose heartbeat stops drops off the live list after this long."""

START_RETRY_FIRST_DELAY_S = 0.2
START_RETRY_MAX_DELAY_S = 5.0


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
        claim_token: str,
        deltas: DeltaPublisher | None = None,
        reserve: TierReserve | None = None,
        tiers: Collection[Tier] = TIERS_BY_PRIORITY,
    ) -> None:
        self.settings = settings
        self.tiers = frozenset(tiers)
        """The tiers whose queues this worker takes from (`inferq worker --tiers`)."""
        self.store = store
        self.engine = engine
        self.redis = redis_client
        self.worker_name = worker_name
        self.publisher = EventPublisher(redis_client, settings.job_key_ttl_s)
        self.stats = WorkerStats()
        self.serving = Serving(settings.model_name, settings.lora).encode()
        self.leases = Leases(redis_client, settings.lease_ttl_s)
        self.deltas = deltas
        self.reserve = reserve
        # engine request id → the tier and KV tokens the reserve counts for it
        self._kv_held: dict[str, EngineRun] = {}
        self.outcomes = OutcomeRecorder(
            store,
            self.publisher,
            self.leases,
            before_final=deltas.flush if deltas else None,
            cache_ttl_s=settings.result_cache_ttl_s,
            lane=settings.lane_of(settings.model_name),
        )
        # Jobs handed to `submit` and not yet ended, for `drain`.
        self._outstanding = 0
        self._idle = threading.Condition()
        # job id → engine request id, for every job this worker is running
        self._running = RunningJobs()
        self._stale_leases = StaleLeases()
        # When the heartbeat next renews running jobs' leases and restarts their streams' TTLs:
        # a job that starts sets both, so none needs it before a third of the TTL from now.
        self._leases_due = time.monotonic() + settings.lease_ttl_s / 3
        self._streams_due = time.monotonic() + self.publisher.ttl_s / 3
        self.starter = JobStarter(
            settings=settings,
            store=store,
            engine=engine,
            redis_client=redis_client,
            worker_name=worker_name,
            claim_token=claim_token,
            publisher=self.publisher,
            stats=self.stats,
            leases=self.leases,
            outcomes=self.outcomes,
            running=self._running,
            stale_leases=self._stale_leases,
            kv_held=self._kv_held,
            cancel=self.cancel,
            watch=self.watch,
            deltas=deltas,
            reserve=reserve,
        )

    def submit(self, job_id: str, on_end: Callable[[JobStatus | None], None]) -> None:
        """Run the job if it still needs running, without waiting for it.

        `on_end` gets the final status it recorded, or None if the job was skipped or its run
        broke off (logged; its lease then lapses and the reaper hands it on). It is called on
        one of the worker's own threads and must not block. While Redis or the database is
        out, starting is tried again later; the message stays unacknowledged meanwhile, so the
        job is neither lost nor run twice.
        """
        with self._idle:
            self._outstanding += 1
        self._begin(job_id, _Once(partial(self._ended, on_end)), START_RETRY_FIRST_DELAY_S)

    def held(self) -> int:
        """Jobs handed to `submit` and not yet ended (the worker's prefetch limit counts them)."""
        return self._outstanding

    def run(self, job_id: str) -> JobStatus | None:
        """`submit`, and wait: the job's final status, or None if skipped."""
        ended: Future[JobStatus | None] = Future()
        self.submit(job_id, ended.set_result)
        return ended.result()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every job handed to `submit` has ended; False if `timeout_s` ran out."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout_s)

    def _ended(self, on_end: Callable[[JobStatus | None], None], status: JobStatus | None) -> None:
        try:
            on_end(status)
        except Exception:  # the job is recorded either way; its message is redelivered
            log.exception("a job's end callback failed")
        finally:
            with self._idle:
                self._outstanding -= 1
                if self._outstanding == 0:
                    self._idle.notify_all()

    def _begin(
        self, job_id: str, ended: Callable[[JobStatus | None], None], delay_s: float
    ) -> None:
        """Hand the job to the starter; its answer goes on in `_on_start`."""
        ticket = self.starter.start(job_id)
        ticket.add_done_callback(partial(self._on_start, job_id, ended, delay_s))

    def _on_start(
        self,
        job_id: str,
        ended: Callable[[JobStatus | None], None],
        delay_s: float,
        ticket: Future[StartOutcome],
    ) -> None:
        # Each step of the chain runs as a future's callback, whose exceptions
        # concurrent.futures logs and drops: one that escaped would leave the job's message
        # unacknowledged and `drain` waiting for good, so the job ends (None) instead.
        try:
            self._go_on_from_start(job_id, ended, delay_s, ticket)
        except Exception:
            log.exception("job %s: could not go on from its start", job_id)
            ended(None)

    def _go_on_from_start(
        self,
        job_id: str,
        ended: Callable[[JobStatus | None], None],
        delay_s: float,
        ticket: Future[StartOutcome],
    ) -> None:
        error = ticket.exception()
        if isinstance(error, UNAVAILABLE):
            log.warning("job %s: could not start, retrying in %.1fs: %s", job_id, delay_s, error)
            retry = threading.Timer(
                delay_s, self._begin, (job_id, ended, min(delay_s * 2, START_RETRY_MAX_DELAY_S))
            )
            retry.daemon = True
            retry.start()
            return
        if error is not None:
            log.error("job %s: could not start", job_id, exc_info=error)
            ended(None)
            return
        started = ticket.result()
        if not isinstance(started, Started):
            ended(started)
            return
        started.generation.add_done_callback(partial(self._on_generated, started, ended))

    def _on_generated(
        self,
        started: Started,
        ended: Callable[[JobStatus | None], None],
        generation: Future[GenerationResult],
    ) -> None:
        job = started.job
        # A later attempt of the same job may have started here meanwhile: leave it be.
        self._running.end(job.id, started.request_id)
        run = self._kv_held.pop(started.request_id, None)
        if run is not None and self.reserve is not None:
            self.reserve.job_ended(run)
        with self.stats.lock:
            self.stats.in_flight -= 1
        try:
            error = generation.exception()
            if error is not None:
                log.error("job %s: its run broke off", job.id, exc_info=error)
                ended(None)
                return
            recorded = self.outcomes.record_async(job, generation.result(), started.token)
            recorded.add_done_callback(partial(_on_recorded, job.id, ended))
        except Exception:  # see `_on_start`: its lease lapses and the reaper hands it on
            log.exception("job %s: could not hand its outcome over", job.id)
            ended(None)

    def watch(self, job_id: str) -> None:
        """Publish the job's deltas live from now on, if it runs here (a reader follows it)."""
        if self.deltas is not None:
            self.deltas.watch(job_id)

    def cancel(self, job_id: str) -> bool:
        """Abort a job this worker is running; False if it is not running here."""
        request_id = self._running.request_of(job_id)
        return request_id is not None and self.engine.cancel(request_id)

    def renew_leases(self) -> None:
        """Publish this worker's counters and the model it serves; every third of their TTLs,
        extend the lease and restart the event stream's TTL of every job in flight here.

        The heartbeat calls this every second; it also releases the leases this worker may
        still hold without knowing it (`StaleLeases`), and watches running jobs that have
        pub/sub subscribers, so their deltas go out live. A lease or a stream needs no renewal
        sooner: each job set both as it started, and a dead worker is noticed by its name's
        claim, not its leases (`core.workernames`).
        """
        running = self._running.job_ids()
        stale = self._stale_leases.pending()
        pipe = self.redis.pipeline(transaction=False)
        now = time.monotonic()
        renewing = bool(running) and now >= self._leases_due
        restarting = bool(running) and now >= self._streams_due
        if renewing:
            self.leases.renew(running, pipe)
        if restarting:  # deltas leave their stream's TTL as it is (core.events)
            self.publisher.restart_ttls(running, pipe)
        self.leases.release(stale, pipe)
        counters = self.stats.as_mapping()
        for tier in TIERS_BY_PRIORITY:  # routing sends a worker jobs only of tiers it takes
            counters[keys.worker_takes_field(tier)] = int(tier in self.tiers)
        if self.reserve is not None:  # admission control counts free slots as starting at once
            for tier, room in self.reserve.left().items():
                counters[keys.worker_room_field(tier)] = room
        IN_FLIGHT.labels(self.worker_name).set(counters["in_flight"])
        if self.reserve is not None and self.reserve.pace is not None:
            self._show_pace(self.reserve.pace)
        pipe.hset(keys.worker_stats(self.worker_name), mapping=counters)
        pipe.expire(keys.worker_stats(self.worker_name), STATS_TTL_S)
        pipe.set(keys.worker_serves(self.worker_name), self.serving, ex=STATS_TTL_S)
        pipe.sadd(keys.WORKERS_SET, self.worker_name)
        if running and self.deltas is not None:
            # Readers subscribed to a job's channel straight on Redis watch it too.
            pipe.pubsub_numsub(*(keys.job_events_channel(job_id) for job_id in running))
        replies = pipe.execute()
        self._stale_leases.forget(stale)
        if renewing:
            self._leases_due = now + self.settings.lease_ttl_s / 3
        if restarting:
            self._streams_due = now + self.publisher.ttl_s / 3
        if running and self.deltas is not None:
            for job_id, (_channel, subscribers) in zip(running, replies[-1], strict=True):
                if subscribers:
                    self.deltas.watch(job_id)

    def _show_pace(self, pace: DeadlinePace) -> None:
        TIME_PER_TOKEN.labels(self.worker_name).set(pace.time_per_token() or 0.0)
        held_back = pace.held_back()
        for tier in TIERS_BY_PRIORITY:
            HELD_FOR_PACE.labels(self.worker_name, tier.value).set(int(tier in held_back))

    def retire(self) -> None:
        """Take this worker off the list of live workers.

        Its name stays in the workers set, so the dispatcher hands whatever is left in (or
        comes back to) its own queues over to the shared ones.
        """
        self.redis.delete(keys.worker_stats(self.worker_name), keys.worker_serves(self.worker_name))


def _on_recorded(
    job_id: str, ended: Callable[[JobStatus | None], None], recorded: Future[JobStatus | None]
) -> None:
    error = recorded.exception()
    if error is not None:
        log.error("job %s: could not record its outcome", job_id, exc_info=error)
        ended(None)
        return
    ended(recorded.result())


class _Once:
    """A job's `ended`: the first call counts, and any later one (after a step of the chain
    raised past it) is ignored, so its message is acknowledged once and `drain` counts it once.
    """

    __slots__ = ("_callback", "_called")

    def __init__(self, callback: Callable[[JobStatus | None], None]) -> None:
        self._callback = callback
        self._called = False

    def __call__(self, status: JobStatus | None) -> None:
        if self._called:
            return
        self._called = True
        self._callback(status)
