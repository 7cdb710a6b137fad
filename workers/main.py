"""`inferq worker`: pin devices, load the engine once, then consume the tier queues."""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Sequence

import redis
from celery.signals import worker_ready

from core import keys
from core.db import Database
from core.events import EventPublisher
from core.health import Health
from core.heap import freeze_heap
from core.jobs import JobStore
from core.logs import set_context
from core.metrics import HOLDS_FOR_PACE, serve_metrics
from core.queue.app import make_celery_app
from core.redisconn import parse_sentinel, sync_client, version_problem
from core.settings import Settings
from core.tiers import TIERS_BY_PRIORITY, Tier
from core.tracing import init_tracing
from core.tracing import shutdown as shutdown_tracing
from core.workernames import WorkerNameClaim, WorkerNameTaken, claim_first_free, claim_name
from workers.devices import DeviceSpec, pin_devices, unbind_extra_cpu_engine
from workers.edge import JobsHeld
from workers.merging import MergingEngine
from workers.metrics import DeviceMemory
from workers.pace import DeadlinePace
from workers.reserve import TierReserve
from workers.runner import JobRunner
from workers.streams import DeltaPublisher
from workers.tasks import register_tasks

log = logging.getLogger(__name__)


class _Heartbeat(threading.Thread):
    """Renews the leases of jobs in flight, publishes the worker's counters, samples memory."""

    def __init__(
        self, runner: JobRunner, memory: DeviceMemory, interval_s: float, health: Health
    ) -> None:
        super().__init__(name="inferq-heartbeat", daemon=True)
        self.runner = runner
        self.memory = memory
        self.interval_s = interval_s
        self.health = health
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self.health.beat()
            try:
                self.runner.renew_leases()
            except redis.RedisError:
                log.warning("heartbeat could not reach Redis; retrying", exc_info=True)
            try:
                self.memory.sample()
            except Exception:
                log.debug("could not sample device memory", exc_info=True)


class _ControlListener(threading.Thread):
    """Aborts running jobs whose ids arrive on the cancel channel; watches those on the watch
    channel (a reader follows them: their deltas go out live)."""

    def __init__(self, runner: JobRunner, client: redis.Redis) -> None:
        super().__init__(name="inferq-control-listener", daemon=True)
        self.runner = runner
        self.pubsub = client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(keys.CANCEL_CHANNEL, keys.WATCH_CHANNEL)
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                message = self.pubsub.get_message(timeout=1.0)
            except redis.RedisError:
                log.warning("control listener lost Redis; resubscribing", exc_info=True)
                self.stopped.wait(1.0)
                continue
            if not message or message["type"] != "message":
                continue
            job_id = message["data"].decode()
            if message["channel"].decode() == keys.WATCH_CHANNEL:
                self.runner.watch(job_id)
            elif self.runner.cancel(job_id):
                log.info("aborted job %s on request", job_id)


def _tick() -> None:
    """Nothing: firing at all is what wakes Celery's event loop."""


def claim_node_name(
    client: redis.Redis, spec: DeviceSpec, name: str | None, ttl_s: float
) -> WorkerNameClaim:
    """This worker's node name, held in Redis while it lives (see `core.workernames`).

    A name given explicitly is waited for briefly (its holder may be this worker's previous
    life); without one, the first free name for the devices: `cpu@host`, `cpu.2@host`, …
    """
    if name is not None:
        return claim_name(client, name, ttl_s=ttl_s)
    return claim_first_free(client, spec.node_names(), ttl_s=ttl_s)


def run_worker(
    settings: Settings,
    spec: DeviceSpec,
    *,
    concurrency: int | None = None,
    name: str | None = None,
    metrics_port: int | None = None,
    tiers: Sequence[Tier] = TIERS_BY_PRIORITY,
) -> int:
    """Run a worker until it is told to stop; returns the exit code.

    It takes jobs of `tiers` only (default all), highest first.
    """
    pin_devices(spec)
    client = sync_client(settings.redis_url)
    if problem := version_problem(client):
        log.error("%s", problem)
        return 1
    try:
        name_claim = claim_node_name(client, spec, name, settings.worker_name_ttl_s)
    except WorkerNameTaken as exc:
        log.error("%s", exc)
        return 1
    atexit.register(name_claim.release)  # also when starting fails (a no-op once released)
    node_name = name_claim.name
    lane = settings.lane_of(settings.model_name)  # its model's queues (`core.keys.queue_name`)
    set_context(worker=node_name)
    if unbind_extra_cpu_engine(spec, node_name):
        log.info("not the host's first CPU worker: its engine's threads are not bound to cores")
    init_tracing("inferq-worker", settings.otlp_endpoint)
    # Live while its heartbeat turns; ready from the moment it takes jobs until it drains.
    health = Health()
    serve_metrics(settings.worker_metrics_port if metrics_port is None else metrics_port, health)
    from workers.engine import VllmEngine  # imports vllm: only after pinning

    deltas = DeltaPublisher(EventPublisher(client, settings.job_key_ttl_s))
    engine = MergingEngine(deltas.publish_step, enabled=settings.merge_requests)
    # Stock Celery's transport takes no notice of the tier reserve, nor of pacing, which acts
    # through it: neither is kept, and the heartbeat publishes no room per tier.
    stock = settings.celery_mode == "stock"
    pace = (
        DeadlinePace(on_hold=lambda tier: HOLDS_FOR_PACE.labels(node_name, tier.value).inc())
        if settings.deadline_pacing and not stock
        else None
    )
    for tier in TIERS_BY_PRIORITY:  # each series shows from the start, at 0
        HOLDS_FOR_PACE.labels(node_name, tier.value)

    vllm = VllmEngine(
        settings,
        device=spec.kind,
        num_gpus=len(spec.gpus),
        on_deltas=engine.on_deltas if pace is None else pace.watching(engine.on_deltas),
        stats_label=node_name if settings.engine_metrics else None,
    )
    vllm.start()
    # The engine's objects, the bulk of the heap, are collected and frozen while the claim's
    # long start-up TTL still runs: walking them stops every thread, the claim's renewer too,
    # for up to 0.7 s on a quiet host and longer on one short of CPU. The freeze at ready
    # then walks only what was made since.
    freeze_heap()
    name_claim.started()  # the engine is loaded: the claim's short TTL applies from now on
    engine.attach(vllm)
    runner = JobRunner(
        settings=settings,
        store=JobStore(Database(settings.sqlalchemy_url)),
        engine=engine,
        redis_client=client,
        worker_name=node_name,
        claim_token=name_claim.token,
        deltas=deltas,
        reserve=None
        if stock
        else TierReserve(
            settings.tiers,
            slots=concurrency or settings.worker_concurrency,
            kv_tokens=vllm.kv_cache_tokens(),
            pace=pace,
            tiers=tiers,
        ),
        tiers=tiers,
    )
    heartbeat = _Heartbeat(
        runner,
        DeviceMemory(node_name, spec.gpus),
        interval_s=min(1.0, settings.lease_ttl_s / 3),
        health=health,
    )
    listener = _ControlListener(runner, client)
    listener.start()

    def announce(**_: object) -> None:
        # Celery's event loop polls Redis for the next message only when it wakes, and with
        # nothing else to do it sleeps up to 10 s; a slot freed meanwhile would sit idle that
        # long. A 0.1 s timer bounds the wait for a freed slot to take the next queued job.
        hub = getattr(worker, "hub", None)
        if hub is not None:
            hub.call_repeatedly(0.1, _tick)
        # Shown as live only once it consumes, so "a worker is up" means "jobs will run";
        # its lane first, so that routing never takes it for a worker of the first model.
        if lane is None:
            client.hdel(keys.WORKER_LANES, node_name)
        else:
            client.hset(keys.WORKER_LANES, node_name, lane)
        client.sadd(keys.WORKERS_SET, node_name)
        runner.renew_leases()
        heartbeat.start()
        health.set_ready(True)
        # Start-up is over: full collections of the engine's and Celery's objects stalled
        # the whole worker for up to 0.7 s at a time (core.heap). What Celery and the runner
        # made since the engine's freeze joins it.
        freeze_heap()

    worker_ready.connect(announce, weak=False)

    app = make_celery_app(settings)
    if not stock:
        # Bulk takes (see workers.edge; edge_batch 1 takes one message at a time, as kombu
        # does), a prefetch limit that still counts the jobs taken before a reconnect, and a
        # channel that survives losing Redis.
        app.conf.broker_transport = (
            "workers.edge:EdgeBatchingSentinelTransport"
            if parse_sentinel(settings.redis_url)
            else "workers.edge:EdgeBatchingTransport"
        )
        app.conf.broker_transport_options = {
            **app.conf.broker_transport_options,
            "edge_batch": settings.edge_batch,
            "jobs_held": JobsHeld(runner.held),
            # Each tier takes from its queues only while it has room here (workers.reserve).
            "tier_reserve": runner.reserve,
        }
    # Each message's job goes straight to the runner, unless task events need Celery's own
    # per-task requests or the stock mode asks for Celery's own strategy (see workers.tasks).
    register_tasks(app, runner, direct=not (settings.task_events or stock))
    worker = app.Worker(
        hostname=node_name,
        pool="threads",
        concurrency=concurrency or settings.worker_concurrency,
        # Per tier, jobs routed here by prompt prefix first, then its model's shared queue.
        queues=[
            queue
            for tier in TIERS_BY_PRIORITY
            if tier in tiers
            for queue in (keys.worker_queue_name(tier, node_name), keys.queue_name(tier, lane))
        ],
        loglevel=settings.log_level,
        without_mingle=True,
        without_gossip=True,
    )
    try:
        worker.start()
        health.set_ready(False)
        # Celery has stopped taking messages; the jobs it handed over finish here (their
        # leases renewed meanwhile). Their messages went back to the queue when Celery's
        # connection closed, and whoever takes them again skips these jobs.
        if not runner.drain(timeout_s=0):
            log.info("worker %s: waiting for the jobs in flight", node_name)
            runner.drain()
    finally:
        heartbeat.stopped.set()
        listener.stopped.set()
        runner.retire()
        engine.shutdown()
        shutdown_tracing()
        log.info("worker %s stopped", node_name)
        # Last: a worker restarted under this name waits until this one has let go of it.
        name_claim.release()
    return int(worker.exitcode or 0)
