"""The Celery app on the Redis broker, with one queue per SLA tier, and `enqueue_job`."""

from __future__ import annotations

from functools import lru_cache

from celery import Celery
from kombu import Queue

from core import celery_compat, keys
from core.celery_compat import PUBLISH_BATCH, run_job_messages
from core.redisconn import celery_broker
from core.settings import Settings, get_settings
from core.tiers import TIERS_BY_PRIORITY, Tier

RUN_JOB_TASK = "inferq.run_job"
ENQUEUED_AT_HEADER = "inferq_enqueued_at"
"""Message header: when the job was submitted (Unix seconds), for aging."""
REDELIVER_UNACKED_AFTER_S = 30


def make_celery_app(settings: Settings) -> Celery:
    """A Celery app whose workers take premium jobs first and never hoard what they can't start.

    Stops with `celery_compat.UntestedCeleryError` where inferq's mode of Celery cannot run.
    """
    celery_compat.check(settings.celery_mode)
    broker, transport_options = celery_broker(settings.redis_url)
    app = Celery("inferq", broker=broker, set_as_current=False)
    app.conf.update(
        task_queues=[Queue(keys.queue_name(tier)) for tier in TIERS_BY_PRIORITY],
        task_default_queue=keys.queue_name(Tier.STANDARD),
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        # A job is acknowledged only once it has ended, so a lost worker's jobs are redelivered.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # Each in-flight slot reserves one message, no more: queued jobs stay in Redis, where a
        # premium job that arrives later is still taken before them.
        worker_prefetch_multiplier=1,
        broker_transport_options={
            **transport_options,  # Sentinel's service, where INFERQ_REDIS_URL names one
            # Poll the tier queues in the declared order every time, not round-robin.
            "queue_order_strategy": "priority",
            # kombu's restore of a message taken by a worker that died before starting its job,
            # after this (on a sweep about every 100 s): the fallback where no scheduler runs,
            # which puts such messages back sooner (`core.queue.unstarted`). Live workers' long
            # jobs get one duplicate delivery, which their lease skips.
            "visibility_timeout": REDELIVER_UNACKED_AFTER_S,
        },
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        # Task events feed Flower's task pages but cost several Redis messages per job;
        # workers and their heartbeats show in Flower either way.
        worker_send_task_events=settings.task_events,
        task_send_sent_event=settings.task_events,
        # inferq's own key: "stock" publishes with `send_task` and runs the worker on Celery's
        # own transport and strategy (see core.celery_compat).
        inferq_celery_mode=settings.celery_mode,
        # inferq's own key: Redis as inferq names it (`core.redisconn`), for its own clients.
        inferq_redis_url=settings.redis_url,
    )
    return app


@lru_cache
def celery_app() -> Celery:
    """The process-wide Celery app, configured from the settings."""
    return make_celery_app(get_settings())


def enqueue_job(
    app: Celery, job_id: str, tier: Tier | str, headers: dict[str, str] | None = None
) -> None:
    """Put a committed job's id on its tier's queue, whatever its length (see `dispatch`).

    The message carries the id and nothing else of the job; `headers` carry its trace context
    and submission time.
    """
    enqueue_jobs(app, [(job_id, tier)], [headers or {}])


def enqueue_jobs(
    app: Celery,
    jobs: list[tuple[str, Tier | str]],
    headers: list[dict[str, str]] | None = None,
    queues: list[str | None] | None = None,
) -> None:
    """Enqueue many committed jobs (id, tier) in one Redis round trip.

    `headers` are per job; so are `queues`, where a job goes to a queue other than its tier's
    (None: its tier's). It is not a transaction: an error midway may leave some messages sent,
    and a caller that sends the group again (as `Dispatcher.submit_or_defer` does) gives those
    jobs a second message, which workers skip.

    `core.celery_compat.RunJobMessages` makes the messages; with task events on (for their
    task-sent events, for Flower) or in the stock mode, Celery sends each itself, batched in one
    pipeline by kombu, and (but in the stock mode, whose workers wait on the queues themselves)
    a second round trip wakes waiting workers (`core.queue.wake`).
    """
    targets = [
        (queues[index] if queues else None) or keys.queue_name(tier)
        for index, (_, tier) in enumerate(jobs)
    ]
    per_job = headers or [{}] * len(jobs)
    if not app.conf.task_send_sent_event and app.conf.get("inferq_celery_mode") != "stock":
        run_job_messages(app, RUN_JOB_TASK).push([job_id for job_id, _ in jobs], targets, per_job)
        return
    with app.producer_or_acquire() as producer, producer.batch(max_size=PUBLISH_BATCH):
        for (job_id, _), queue, extra in zip(jobs, targets, per_job, strict=True):
            app.send_task(
                RUN_JOB_TASK, args=[job_id], queue=queue, producer=producer, headers=extra
            )
    if app.conf.get("inferq_celery_mode") != "stock":
        run_job_messages(app, RUN_JOB_TASK).wake(targets)
