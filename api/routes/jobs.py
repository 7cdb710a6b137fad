"""`/v1/jobs`: submit, poll (or long-poll), list and cancel generation jobs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from api.cancelling import cancel_job
from api.deps import PrincipalDep, ServicesDep
from api.negotiation import MsgpackRoute, NegotiatedResponse
from api.openapi import COMMON_ERRORS, error_responses
from api.prefer import honour_wait
from api.schemas import (
    FeedbackCreate,
    JobBatchCreate,
    JobCreate,
    JobList,
    JobOut,
    decode_cursor,
    encode_cursor,
)
from api.streaming import event_stream
from api.submission import submit_job, submit_jobs
from core.errors import NotFound
from core.metrics import EXPERIMENT_FEEDBACK
from core.states import JobStatus

router = APIRouter(
    prefix="/v1/jobs",
    tags=["jobs"],
    route_class=MsgpackRoute,
    default_response_class=NegotiatedResponse,
    responses=COMMON_ERRORS,
)

MAX_WAIT_S = 60.0
CANCEL_WAIT_S = 5.0
PREFER_HELP = (
    "`wait=N` (RFC 7240): answer once the job has ended (200), or as it stands after N "
    "seconds (202); at most 60."
)


@router.post(
    "",
    status_code=202,
    response_model=JobOut,
    responses={
        200: {
            "model": JobOut,
            "content": {"text/event-stream": {}},
            "description": "The job stored earlier under this Idempotency-Key, or with Prefer: "
            "wait, the job once it has ended; with stream=true, the job's events.",
        },
        **error_responses(404, 409, 413, 429),
    },
)
async def create_job(
    body: JobCreate,
    principal: PrincipalDep,
    services: ServicesDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
    stream: Annotated[bool, Query(description="Answer with the job's events (SSE).")] = False,
    cancel_on_disconnect: Annotated[
        bool, Query(description="With stream: cancel the job if the client goes away first.")
    ] = True,
    prefer: Annotated[str | None, Header(description=PREFER_HELP)] = None,
) -> Response:
    """Queue a job on the caller's tier; a repeated Idempotency-Key returns the same job.

    With `stream=true` the answer is the job's event stream (as `GET /v1/jobs/{id}/events`),
    and a client that disconnects before the final event cancels the job unless
    `cancel_on_disconnect=false`. With `Prefer: wait=N` the answer waits for the job to end
    (see `api.prefer`).
    """
    job, created = await submit_job(services, principal, body, idempotency_key)
    if stream:
        return event_stream(
            services,
            job,
            0,
            cancel_owner=principal.owner if cancel_on_disconnect else None,
            headers={"Location": f"/v1/jobs/{job.id}"},
        )
    [job], status_code, headers = await honour_wait(services, [job], prefer, MAX_WAIT_S)
    headers.update(
        {"Location": f"/v1/jobs/{job.id}", "Idempotent-Replayed": str(not created).lower()}
    )
    return NegotiatedResponse(
        JobOut.from_job(job).model_dump(mode="json"),
        status_code=status_code or (202 if created else 200),
        headers=headers,
    )


@router.post(
    "/batch",
    status_code=202,
    response_model=JobList,
    responses={
        200: {"model": JobList, "description": "With Prefer: wait, every job has ended."},
        **error_responses(404, 413, 429),
    },
)
async def create_jobs(
    body: JobBatchCreate,
    principal: PrincipalDep,
    services: ServicesDep,
    prefer: Annotated[str | None, Header(description=PREFER_HELP)] = None,
) -> NegotiatedResponse:
    """Queue many jobs at once (one transaction, one broker connection); all or none.

    With `Prefer: wait=N` the answer waits until every job has ended, up to N seconds.
    """
    jobs = await submit_jobs(services, principal, body.jobs)
    jobs, status_code, headers = await honour_wait(services, jobs, prefer, MAX_WAIT_S)
    page = JobList(data=[JobOut.from_job(job) for job in jobs], next_cursor=None)
    return NegotiatedResponse(
        page.model_dump(mode="json"), status_code=status_code or 202, headers=headers
    )


@router.get("/{job_id}", response_model=JobOut, responses=error_responses(404))
async def get_job(
    job_id: str,
    principal: PrincipalDep,
    services: ServicesDep,
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S)] = 0,
) -> JobOut:
    """The job; with `wait=N`, hold the request up to N seconds for it to reach a final state."""
    with services.finals.watch([job_id] if wait > 0 else ()) as finals:  # before the read
        job = await run_in_threadpool(services.jobs.get, job_id, principal.owner)
        if job is None:
            raise NotFound(f"No job with id '{job_id}'.", param="job_id")
        if wait > 0 and not JobStatus(job.status).is_final:
            await finals.wait(wait)
            job = await services.reads.get(job_id)
            assert job is not None
    return JobOut.from_job(job)


@router.post("/{job_id}/feedback", response_model=JobOut, responses=error_responses(404))
async def post_feedback(
    job_id: str, body: FeedbackCreate, principal: PrincipalDep, services: ServicesDep
) -> JobOut:
    """Score the job's answer; an experiment's report and metrics average it per variant."""
    job = await run_in_threadpool(services.jobs.set_feedback, job_id, principal.owner, body.score)
    if job is None:
        raise NotFound(f"No job with id '{job_id}'.", param="job_id")
    if job.experiment is not None and job.variant is not None:
        EXPERIMENT_FEEDBACK.labels(job.experiment, job.variant).observe(body.score)
    return JobOut.from_job(job)


@router.get("", response_model=JobList)
async def list_jobs(
    principal: PrincipalDep,
    services: ServicesDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    status: JobStatus | None = None,
    cursor: str | None = None,
) -> JobList:
    """The caller's jobs, newest first; follow `next_cursor` for the next page."""
    before = decode_cursor(cursor) if cursor else None
    jobs = await run_in_threadpool(
        lambda: services.jobs.list_for_owner(
            principal.owner, limit=limit + 1, status=status, before=before
        )
    )
    page = jobs[:limit]
    next_cursor = encode_cursor(page[-1]) if len(jobs) > limit else None
    return JobList(data=[JobOut.from_job(job) for job in page], next_cursor=next_cursor)


@router.delete(
    "/{job_id}",
    response_model=JobOut,
    responses={
        202: {"model": JobOut, "description": "Still stopping"},
        **error_responses(404, 409),
    },
)
async def delete_job(
    job_id: str, principal: PrincipalDep, services: ServicesDep
) -> NegotiatedResponse:
    """Cancel the job: 200 with the job once it has ended, 202 if its worker is still stopping it.

    A job that has already ended gets 409 with its status.
    """
    job = await cancel_job(services, principal.owner, job_id)
    if not JobStatus(job.status).is_final:
        await services.finals.wait([job_id], CANCEL_WAIT_S)
        refreshed = await run_in_threadpool(services.jobs.get, job_id, principal.owner)
        if refreshed is None:
            raise NotFound(f"No job with id '{job_id}'.", param="job_id")
        job = refreshed
    status_code = 200 if JobStatus(job.status).is_final else 202
    return NegotiatedResponse(JobOut.from_job(job).model_dump(mode="json"), status_code=status_code)
