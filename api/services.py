"""The long-lived clients the API holds, built at start-up and closed at shutdown."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from celery import Celery

from core.apikeys import KeyStore
from core.db import Database
from core.events import AsyncEventPublisher
from core.jobs import JobStore
from core.modelinfo import ModelInfo, load_model_info
from core.settings import Settings
from scheduler.queues import make_celery_app


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
    model: ModelInfo

    @classmethod
    def build(cls, settings: Settings) -> Services:
        """Connect to the configured database, Redis and model files."""
        db = Database(settings.sqlalchemy_url)
        client = aioredis.Redis.from_url(
            settings.redis_url, socket_connect_timeout=2, socket_timeout=10
        )
        return cls(
            settings=settings,
            db=db,
            jobs=JobStore(db),
            keys=KeyStore(db),
            redis=client,
            events=AsyncEventPublisher(client, settings.job_key_ttl_s),
            celery=make_celery_app(settings),
            model=load_model_info(settings.model_path, settings.max_model_len),
        )

    async def close(self) -> None:
        """Release connections."""
        await self.redis.aclose()
        self.celery.close()
