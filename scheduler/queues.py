"""The Celery app on the Redis broker, with one queue per SLA tier, and `enqueue_job`."""

from __future__ import annotations

import base64
import json
import uuid
from collections import defaultdict
from functools import lru_cache
from typing import Any

import redis
from celery import Celery
from kombu import Queue

from core import keys
from core.settings import Settings, get_settings
from core.tiers import TIERS_BY_PRIORITY, Tier

RUN_JOB_TASK = "inferq.run_job"
ENQUEUED_AT_HEADER = "inferq_enqueued_at"
"""Message header: when the job was submitted (Unix seconds), for aging."""
REDELIVER_UNACKED_AFTER_S = 30
PUBLISH_BATCH = 1000
"""Most messages sent in one Redis pipeline; a bigger group goes in several."""


def make_celery_app(settings: Settings) -> Celery:
    """A Celery app whose workers take premium jobs first and never hoard what they can't start."""
    app = Celery("inferq", broker=settings.redis_url, set_as_current=False)
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
            # Poll the tier queues in the declared order every time, not round-robin.
            "queue_order_strategy": "priority",
            # A message taken by a worker that died before starting its job (the job is still
            # queued, so the lease reaper does not see it) goes back to its queue after this.
            # Live workers' long jobs get one duplicate delivery too, which their lease skips.
            "visibility_timeout": REDELIVER_UNACKED_AFTER_S,
        },
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        # Task events feed Flower's task pages but cost several Redis messages per job;
        # workers and their heartbeats show in Flower either way.
        worker_send_task_events=settings.task_events,
        task_send_sent_event=settings.task_events,
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

    `RunJobMessages` makes the messages; with task events on, Celery sends each itself (and
    its task-sent event, for Flower), batched in one pipeline by kombu.
    """
    targets = [
        (queues[index] if queues else None) or keys.queue_name(tier)
        for index, (_, tier) in enumerate(jobs)
    ]
    per_job = headers or [{}] * len(jobs)
    if not app.conf.task_send_sent_event:
        run_job_messages(app).push([job_id for job_id, _ in jobs], targets, per_job)
        return
    with app.producer_or_acquire() as producer, producer.batch(max_size=PUBLISH_BATCH):
        for (job_id, _), queue, extra in zip(jobs, targets, per_job, strict=True):
            app.send_task(
                RUN_JOB_TASK, args=[job_id], queue=queue, producer=producer, headers=extra
            )


class RunJobMessages:
    """`run_job` messages for the Redis broker, made as Celery makes them, minus its per-call work.

    `send_task` spends 150-300 µs a message (routing, option merging, signals, kombu's publish
    path) on a message whose only parts that vary are the job id, two random ids and the
    headers. This asks Celery for the message once and fills in those parts per job: the worker
    receives what `send_task` would have sent (a test compares the two on a real Redis). The
    messages go out as one LPUSH per queue, in order, so they are taken first in, first out
    like Celery's.
    """

    def __init__(self, app: Celery) -> None:
        template = app.amqp.as_task_v2("", RUN_JOB_TASK, args=[""], ignore_result=None)
        self._headers: dict[str, Any] = dict(template.headers)
        self._embed = template.body[2]
        self._reply_to = str(app.thread_oid)
        self._client = redis.Redis.from_url(
            str(app.conf.broker_url), socket_connect_timeout=2, socket_timeout=10
        )

    def message(self, job_id: str, queue: str, headers: dict[str, str]) -> bytes:
        """The message that runs `job_id`, serialized as kombu's Redis transport stores it."""
        task_id = str(uuid.uuid4())
        body = json.dumps([[job_id], {}, self._embed]).encode()
        envelope = {
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {
                **self._headers,
                "id": task_id,
                "root_id": task_id,
                "argsrepr": repr([job_id]),
                **headers,
            },
            "properties": {
                "correlation_id": task_id,
                "reply_to": self._reply_to,
                "delivery_mode": 2,
                "delivery_info": {"exchange": "", "routing_key": queue},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },
        }
        return json.dumps(envelope).encode()

    def push(self, job_ids: list[str], queues: list[str], headers: list[dict[str, str]]) -> None:
        """Put each job's message on its queue: one LPUSH per queue, all in one round trip."""
        by_queue: dict[str, list[bytes]] = defaultdict(list)
        for job_id, queue, extra in zip(job_ids, queues, headers, strict=True):
            by_queue[queue].append(self.message(job_id, queue, extra))
        pipe = self._client.pipeline(transaction=False)
        for queue, messages in by_queue.items():
            for start in range(0, len(messages), PUBLISH_BATCH):
                pipe.lpush(queue, *messages[start : start + PUBLISH_BATCH])
        pipe.execute()


@lru_cache(maxsize=8)
def run_job_messages(app: Celery) -> RunJobMessages:
    """The app's message maker (and its Redis client), made on first use."""
    return RunJobMessages(app)
