"""`/v1/batches`: OpenAI's Batch API — create, retrieve, list and cancel batches.

Each request line of the input file becomes an ordinary job on the caller's tier. Reading a
batch (retrieve, list, cancel) also moves it on: see `api.openai.batches`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool

from api.deps import PrincipalDep, ServicesDep
from api.openai.batch_protocol import BatchCreate, batch_object
from api.openai.batches import advance, cancel_batch, create_batch, get_batch
from api.openai.file_router import page
from api.openapi import COMMON_ERRORS, error_responses
from core.errors import InvalidRequest
from core.openai_batches import OpenAIBatchStore

router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=COMMON_ERRORS)


@router.post("", responses=error_responses(404, 413, 429))
async def create(
    body: BatchCreate, principal: PrincipalDep, services: ServicesDep
) -> dict[str, Any]:
    """Run every request line of an uploaded file (purpose `batch`) as a job.

    Invalid lines go to the error file; a duplicate custom_id rejects the batch (400).
    """
    batch = await create_batch(services, principal, body)
    batch, counts = await advance(services, batch)
    return batch_object(batch, counts)


@router.get("")
async def list_batches(
    principal: PrincipalDep,
    services: ServicesDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> dict[str, Any]:
    """The caller's batches, newest first; `after` (a batch id) pages on."""
    store = OpenAIBatchStore(services.db)
    anchor = None
    if after is not None:
        anchor = await run_in_threadpool(store.get, after, principal.owner)
        if anchor is None:
            raise InvalidRequest(f"No batch with id '{after}' to list after.", param="after")
    batches = await run_in_threadpool(
        lambda: store.list_for_owner(principal.owner, limit=limit + 1, after=anchor)
    )
    data = [batch_object(*await advance(services, batch)) for batch in batches[:limit]]
    return page(data, len(batches) > limit)


@router.get("/{batch_id}", responses=error_responses(404))
async def retrieve(batch_id: str, principal: PrincipalDep, services: ServicesDep) -> dict[str, Any]:
    """The batch, with its request counts (finished once all its requests have ended)."""
    batch = await get_batch(services, principal.owner, batch_id)
    return batch_object(*await advance(services, batch))


@router.post("/{batch_id}/cancel", responses=error_responses(404, 409))
async def cancel(batch_id: str, principal: PrincipalDep, services: ServicesDep) -> dict[str, Any]:
    """Cancel the requests not yet final: `cancelling`, then `cancelled` once they have ended."""
    batch, counts = await cancel_batch(services, principal.owner, batch_id)
    return batch_object(batch, counts)
