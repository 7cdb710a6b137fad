"""The long-lived clients the API holds, built at start-up and closed at shutdown."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from celery import Celery

from api.admission import QueueStateReader
from api.batcher import SubmissionBatcher
from api.event_relay import REDIS_PATIENCE_S, EventRelay
from api.final_events import FinalEvents
from api.job_reads import JobReads
from core.adapters import AdapterStore
from core.apikeys import KeyStore, Principal
from core.db import Database
from core.events import AsyncEventPublisher
from core.jobs import JobStore
from core.modelinfo import ModelInfo, ServedModels, load_served_models
from core.queue.app import make_celery_app
from core.queue.dispatch import Dispatcher
from core.quotas import QuotaLimiter
from core.redisconn import async_client, sync_client
from core.settings import Settings


class PrincipalCache:
    """Keys checked recently, so a busy client costs one database lookup per TTL, not per call.

    Only live keys are kept: unknown keys always go to the database and cannot fill the cache.
    """

    MAX_ENTRIES = 10_000

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[float, Principal]] = {}

    def get(self, key_hash: str) -> Principal | None:
        """The cached principal, if it is still fresh."""
        entry = self._entries.get(key_hash)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, key_hash: str, principal: Principal) -> None:
        """Remember a key that just authenticated."""
        if self.ttl_s <= 0:
            return
        if len(self._entries) >= self.MAX_ENTRIES:
            self._entries.clear()
        self._entries[key_hash] = (time.monotonic() + self.ttl_s, principal)


@dataclass
class Services:
    """Everything a request handler talks to."""

    settings: Settings
    db: Database
    jobs: JobStore
    keys: KeyStore
    redis: aioredis.Redis
    events: AsyncEventPublisher
    celery: Celery
    models: ServedModels
    principals: PrincipalCache
    submissions: SubmissionBatcher
    dispatcher: Dispatcher
    quotas: QuotaLimiter
    queue_state: QueueStateReader
    finals: FinalEvents
    relay: EventRelay
    reads: JobReads
    adapters: AdapterStore

    @classmethod
    def build(cls, settings: Settings) -> Services:
        """Connect to the configured database, Redis and model files."""
        db = Database(settings.sqlalchemy_url)
        jobs = JobStore(db)
        celery = make_celery_app(settings)
        # Live streams share one connection (`api.event_relay`), waits for a job's end one
        # subscription (`api.final_events`); past the pool's size a request waits up to 5 s
        # for a connection rather than failing at once.
        client = async_client(
            settings.redis_url,
            max_connections=settings.api_redis_connections,
            timeout=5,
            socket_connect_timeout=2,
            socket_timeout=10,
        )
        # Dispatching runs in the thread pool, beside Celery's own (blocking) producer.
        dispatcher = Dispatcher(
            settings,
            sync_client(settings.redis_url, socket_connect_timeout=2, socket_timeout=10),
            celery,
        )
        return cls(
            settings=settings,
            db=db,
            jobs=jobs,
            keys=KeyStore(db),
            redis=client,
            events=AsyncEventPublisher(client, settings.job_key_ttl_s),
            celery=celery,
            models=load_served_models(
                settings.model_path,
                settings.served_model_name,
                settings.models,
                settings.max_model_len,
            ),
            principals=PrincipalCache(settings.auth_cache_ttl_s),
            submissions=SubmissionBatcher(jobs, dispatcher),
            dispatcher=dispatcher,
            quotas=QuotaLimiter(client, settings.job_key_ttl_s),
            queue_state=QueueStateReader(client, settings.lanes),
            finals=FinalEvents(client),
            relay=EventRelay(
                async_client(
                    settings.redis_url,
                    max_connections=1,
                    timeout=5,
                    socket_connect_timeout=2,
                    socket_timeout=10,
                ),
                client,
                patience_s=REDIS_PATIENCE_S,
            ),
            reads=JobReads(jobs),
            adapters=AdapterStore(db),
        )

    @property
    def model(self) -> ModelInfo:
        """The first model (`INFERQ_MODEL`): what a job that names none runs on."""
        return self.models.first

    async def close(self) -> None:
        """Stop taking submissions and release connections."""
        await self.submissions.stop()
        await self.finals.close()
        await self.relay.close()
        await self.redis.aclose()
        self.celery.close()
