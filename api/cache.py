"""Answering repeats of deterministic jobs from the result cache (see `core.resultcache`).

A job that asks for it (the default) and is deterministic gets a cache key; if the cache holds
that key's result, the job is stored already succeeded and its stream gets the whole text as
one delta and a `done` event. It never reaches a queue or an engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import redis.exceptions

from api.services import Services
from core import keys
from core.metrics import JOBS_CACHED, JOBS_FINISHED
from core.models import Job
from core.new_jobs import NewJob
from core.resultcache import CachedResult, is_deterministic, request_key
from core.states import JobStatus

log = logging.getLogger(__name__)


def cache_key_for(
    services: Services,
    model: str,
    prompt_digest: Callable[[], str],
    sampling: dict[str, Any],
    use: bool,
) -> str | None:
    """The job's result-cache key; None when the job is not deterministic or opted out.

    `model`: the job's (an adapter's name makes other text than the served model's).
    `prompt_digest` gives the prompt's digest, called only when the job has a key.
    """
    if not use or services.settings.result_cache_ttl_s <= 0 or not is_deterministic(sampling):
        return None
    return request_key(model, prompt_digest(), sampling)


async def fill_from_cache(services: Services, batch: list[NewJob]) -> list[NewJob]:
    """The batch with every job the cache can answer carrying its cached result."""
    wanted = [new.cache_key for new in batch if new.cache_key is not None]
    if not wanted:
        return batch
    try:
        raw = await services.redis.mget([keys.result_cache(key) for key in wanted])
    except redis.exceptions.RedisError:  # the engine will answer instead
        log.warning("result cache unreachable; running %d jobs", len(wanted), exc_info=True)
        return batch
    hits = {key: CachedResult.loads(value) for key, value in zip(wanted, raw, strict=True) if value}
    return [
        replace(new, cached=hits[new.cache_key]) if new.cache_key in hits else new for new in batch
    ]


async def announce_cached(services: Services, jobs: list[Job]) -> None:
    """Publish each cache-answered job's stream: its text as one delta, then `done`."""
    for job in jobs:
        JOBS_CACHED.labels(job.tier).inc()
        JOBS_FINISHED.labels(job.tier, JobStatus.SUCCEEDED.value).inc()
        text = job.output_text or ""
        if text:
            await services.events.publish(
                job.id,
                "delta",
                attempt=0,
                text=text,
                tokens=job.completion_tokens or 0,
                at=round(time.time(), 6),
            )
        await services.events.publish(
            job.id,
            "done",
            status=JobStatus.SUCCEEDED.value,
            finish_reason=job.finish_reason,
            error_code=None,
            usage={"prompt_tokens": job.prompt_tokens, "completion_tokens": job.completion_tokens},
        )
