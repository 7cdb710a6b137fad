"""Cancelling jobs: a queued one ends at once, a running one's worker is asked to abort it."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from api.services import Services
from core import keys
from core.batches import BatchStore
from core.errors import JobAlreadyFinal, NotFound
from core.metrics import JOBS_FINISHED
from core.models import Job
from core.queue.held import drop_held
from core.states import JobStatus


async def cancel_job(services: Services, owner: str, job_id: str) -> Job:
    """Cancel a queued job at once, or ask its worker to abort a running one.

    The cancel flag lives in Redis (and the state in the database), not in any worker's memory,
    so a queued job that is cancelled never starts, whatever restarts in between.
    """
    job = await run_in_threadpool(services.jobs.get, job_id, owner)
    if job is None:
        raise NotFound(f"No job with id '{job_id}'.", param="job_id")
    if JobStatus(job.status).is_final:
        raise JobAlreadyFinal(
            f"Job '{job_id}' has already ended with status '{job.status}'.", job_status=job.status
        )
    await services.redis.set(keys.job_cancel_flag(job_id), b"1", ex=services.settings.job_key_ttl_s)
    if await run_in_threadpool(services.jobs.cancel_if_queued, job_id):
        JOBS_FINISHED.labels(job.tier, JobStatus.CANCELLED.value).inc()
        await services.events.publish(job_id, "cancelled", status=JobStatus.CANCELLED.value)
    else:
        await services.redis.publish(keys.CANCEL_CHANNEL, job_id)
    refreshed = await run_in_threadpool(services.jobs.get, job_id, owner)
    assert refreshed is not None
    return refreshed


async def cancel_batch_jobs(services: Services, batch_id: str) -> None:
    """End a batch's queued jobs as cancelled now; ask the workers to abort its running ones."""
    cancelled = await run_in_threadpool(BatchStore(services.db).cancel_jobs, batch_id)
    ttl = services.settings.job_key_ttl_s
    pipe = services.redis.pipeline(transaction=False)
    for job_id in [job_id for job_id, _, _ in cancelled.ended] + cancelled.running:
        pipe.set(keys.job_cancel_flag(job_id), b"1", ex=ttl)
    for job_id in cancelled.running:
        pipe.publish(keys.CANCEL_CHANNEL, job_id)
    await pipe.execute()
    for (tier, owner), job_ids in cancelled.ended_by_queue().items():
        await drop_held(services.redis, tier, owner, job_ids, services.settings.lanes)
    for job_id, tier, _ in cancelled.ended:
        JOBS_FINISHED.labels(tier, JobStatus.CANCELLED.value).inc()
        await services.events.publish(job_id, "cancelled", status=JobStatus.CANCELLED.value)
