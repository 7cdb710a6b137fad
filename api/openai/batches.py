"""The life of an OpenAI batch: create it from an input file, advance it, cancel it.

Creating validates every line (the live endpoints' conversion, tier and context checks);
valid lines become the batch's jobs (`submit_jobs`, one transaction with the batch row),
invalid ones are kept with the batch for its error file. The scheduler does not know these
batches, so reading one advances it: past its window its unfinished jobs are cancelled, and
once every job is final one API process (a conditional UPDATE decides which) writes the output
and error files and the end state.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from starlette.concurrency import run_in_threadpool

from api.cancelling import cancel_batch_jobs
from api.openai.batch_protocol import (
    BatchCreate,
    InvalidLine,
    RequestCounts,
    RequestLine,
    invalid_line,
    jsonl,
    line_job,
    parse_input,
    result_records,
)
from api.schemas import JobCreate
from api.services import Services
from api.submission import new_job, submit_jobs
from core.apikeys import Principal
from core.batches import BatchStore, new_batch_id
from core.errors import ClientError, Conflict, InvalidRequest, NotFound
from core.files import FileStore, new_stored_file
from core.models import Batch, StoredFile, as_utc, utcnow
from core.openai_batches import KIND, OpenAIBatchStore
from core.states import JobStatus

log = logging.getLogger(__name__)

COMPLETION_WINDOW = timedelta(hours=24)

RECANCEL_AFTER_S = 30.0
"""A batch still cancelling (or expiring) this long after the decision is cancelled again."""

_UNFINISHED = (JobStatus.QUEUED, JobStatus.RUNNING)


class BatchNotCancellable(Conflict):
    """A cancel for a batch that is finalizing or has already ended."""

    code = "batch_not_cancellable"


async def create_batch(services: Services, principal: Principal, body: BatchCreate) -> Batch:
    """Validate the input file and start its batch (or store it `failed` if no line is valid)."""
    files = FileStore(services.db)
    source = await run_in_threadpool(files.get, body.input_file_id, principal.owner, content=True)
    if source is None:
        raise NotFound(f"No file with id '{body.input_file_id}'.", param="input_file_id")
    if source.purpose != "batch":
        raise InvalidRequest(
            f"File '{source.id}' has purpose '{source.purpose}'; a batch needs purpose 'batch'.",
            param="input_file_id",
        )
    parsed = parse_input(source.content, body.endpoint)
    bodies, custom_ids, invalid = await run_in_threadpool(
        _validate_requests, services, principal, parsed.requests, parsed.invalid, body.endpoint
    )
    now = utcnow()
    batch = Batch(
        id=new_batch_id("batch"),
        kind=KIND,
        owner=principal.owner,
        tier=principal.tier.value,
        status="in_progress",
        request_total=len(bodies) + len(invalid),
        created_at=now,
        metadata_=body.metadata,
        errors=[line.record() for line in invalid] or None,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        input_file_id=source.id,
        in_progress_at=now,
        expires_at=now + COMPLETION_WINDOW,
    )
    if not bodies:
        return await run_in_threadpool(_store_failed, services, batch)
    await submit_jobs(services, principal, bodies, batch_row=batch, custom_ids=custom_ids)
    return batch


def _validate_requests(
    services: Services,
    principal: Principal,
    requests: list[RequestLine],
    invalid: list[InvalidLine],
    endpoint: str,
) -> tuple[list[JobCreate], list[str], list[InvalidLine]]:
    """Each request's job, checked as a live request is; the failures join the invalid lines."""
    bodies: list[JobCreate] = []
    custom_ids: list[str] = []
    rejected = list(invalid)
    adapters = {a.name for a in services.adapters.all()} if services.settings.lora else set()
    for request in requests:
        try:
            job_body = line_job(request, endpoint, services.models, adapters)
            new_job(services, principal, job_body, None)
        except ClientError as exc:
            rejected.append(invalid_line(request, exc))
            continue
        bodies.append(job_body)
        custom_ids.append(request.custom_id)
    rejected.sort(key=lambda line: line.position)
    return bodies, custom_ids, rejected


def _store_failed(services: Services, batch: Batch) -> Batch:
    """A batch none of whose lines is valid: failed at once, with its error file."""
    _, error_lines = result_records(
        batch.id, [], batch.errors or [], services.model.name, batch.endpoint or ""
    )
    error_file = new_stored_file(
        batch.owner, "batch_output", f"{batch.id}_error.jsonl", jsonl(error_lines)
    )
    batch.status = "failed"
    batch.failed_at = batch.finished_at = batch.created_at
    batch.error_file_id = error_file.id
    return OpenAIBatchStore(services.db).add(batch, [error_file])


async def get_batch(services: Services, owner: str, batch_id: str) -> Batch:
    """The owner's batch; 404 otherwise."""
    batch = await run_in_threadpool(OpenAIBatchStore(services.db).get, batch_id, owner)
    if batch is None:
        raise NotFound(f"No batch with id '{batch_id}'.", param="batch_id")
    return batch


async def advance(services: Services, batch: Batch) -> tuple[Batch, RequestCounts]:
    """The batch after moving it on as far as its jobs allow, with its request counts.

    Idempotent, and safe to run in several processes at once: every change is conditional.
    """
    store = OpenAIBatchStore(services.db)
    jobs = BatchStore(services.db)
    counts = await run_in_threadpool(jobs.counts, batch.id)
    unfinished = sum(counts[status] for status in _UNFINISHED)
    if batch.status in ("in_progress", "cancelling", "finalizing"):
        now = utcnow()
        if (
            unfinished
            and batch.status == "in_progress"
            and batch.expired_at is None
            and batch.expires_at is not None
            and now >= as_utc(batch.expires_at)
            and await run_in_threadpool(store.mark_expired, batch.id, now)
        ) or (unfinished and _cancel_is_overdue(batch)):
            await cancel_batch_jobs(services, batch.id)
        if not unfinished:
            await run_in_threadpool(finalize, services, batch.id, batch.owner)
        batch = await get_batch(services, batch.owner, batch.id)
        counts = await run_in_threadpool(jobs.counts, batch.id)
    invalid = len(batch.errors or [])
    return batch, RequestCounts.of(batch.request_total, invalid, counts)


def _cancel_is_overdue(batch: Batch) -> bool:
    decided = batch.cancelling_at if batch.status == "cancelling" else batch.expired_at
    if decided is None:
        return False
    return (utcnow() - as_utc(decided)).total_seconds() >= RECANCEL_AFTER_S


async def cancel_batch(
    services: Services, owner: str, batch_id: str
) -> tuple[Batch, RequestCounts]:
    """Cancel every request not yet final; the batch ends `cancelled` once they all are.

    Cancelling a batch that is already cancelling or cancelled changes nothing; one that is
    finalizing or has ended otherwise is 409.
    """
    batch = await get_batch(services, owner, batch_id)
    store = OpenAIBatchStore(services.db)
    if await run_in_threadpool(store.mark_cancelling, batch.id, utcnow()):
        await cancel_batch_jobs(services, batch.id)
    else:
        batch = await get_batch(services, owner, batch_id)
        if batch.status not in ("cancelling", "cancelled"):
            raise BatchNotCancellable(
                f"Batch '{batch_id}' cannot be cancelled: its status is '{batch.status}'.",
                batch_status=batch.status,
            )
    refreshed = await get_batch(services, owner, batch_id)
    return await advance(services, refreshed)


def finalize(services: Services, batch_id: str, owner: str) -> None:
    """Write the results of a batch whose jobs are all final, and its end state — once.

    Whoever claims `finalizing` writes; a process that loses the claim (or whose claim is taken
    over as stale) stores nothing.
    """
    store = OpenAIBatchStore(services.db)
    claimed_at = utcnow()
    if not store.claim_finalizing(batch_id, claimed_at):
        return
    batch = store.get(batch_id, owner)
    assert batch is not None
    jobs = BatchStore(services.db).jobs(batch_id)
    output_lines, error_lines = result_records(
        batch.id, jobs, batch.errors or [], services.model.name, batch.endpoint or ""
    )
    output = _result_file(batch, "output", output_lines)
    errors = _result_file(batch, "error", error_lines)
    if not store.finish(batch, claimed_at, output, errors):
        log.info("batch %s: another process finalized it first", batch_id)


def _result_file(batch: Batch, name: str, lines: list[dict[str, Any]]) -> StoredFile | None:
    if not lines:
        return None
    return new_stored_file(batch.owner, "batch_output", f"{batch.id}_{name}.jsonl", jsonl(lines))
