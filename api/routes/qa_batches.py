"""`/v1/qa-batches`: one document, many questions; answers collected later."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from api.deps import PrincipalDep, ServicesDep
from api.negotiation import MsgpackRoute, NegotiatedResponse
from api.openapi import COMMON_ERRORS, error_responses
from api.qa_batches import (
    QaBatchCreate,
    QaBatchOut,
    answers_of,
    cancel_batch,
    create_batch,
    describe,
    get_batch,
    render,
)
from core.batches import BatchStore

router = APIRouter(
    prefix="/v1/qa-batches",
    tags=["qa-batches"],
    route_class=MsgpackRoute,
    default_response_class=NegotiatedResponse,
    responses=COMMON_ERRORS,
)

MEDIA_TYPES = {"jsonl": "application/x-ndjson", "csv": "text/csv; charset=utf-8"}


@router.post(
    "", status_code=202, response_model=QaBatchOut, responses=error_responses(404, 413, 429)
)
async def create_qa_batch(
    body: QaBatchCreate, principal: PrincipalDep, services: ServicesDep
) -> NegotiatedResponse:
    """Queue one job per question, all sharing the document as their prompt's prefix.

    All questions are accepted or none: a question that cannot fit the model with the
    document is 400 `context_length_exceeded` (documents are never truncated).
    """
    batch = await create_batch(services, principal, body)
    out = await describe(services, batch, answers=False)
    return NegotiatedResponse(
        out.model_dump(mode="json", exclude_none=True),
        status_code=202,
        headers={"Location": f"/v1/qa-batches/{batch.id}"},
    )


@router.get(
    "/{batch_id}",
    response_model=QaBatchOut,
    response_model_exclude_none=True,
    responses=error_responses(404),
)
async def get_qa_batch(
    batch_id: str,
    principal: PrincipalDep,
    services: ServicesDep,
    answers: Annotated[bool, Query(description="Include the answers so far.")] = True,
) -> QaBatchOut:
    """Counts by state and, unless `answers=false`, every question with its answer so far."""
    batch = await get_batch(services, principal.owner, batch_id)
    return await describe(services, batch, answers=answers)


@router.get(
    "/{batch_id}/results",
    response_class=Response,
    responses={
        200: {"content": {"application/x-ndjson": {}, "text/csv": {}}},
        **error_responses(404),
    },
)
async def get_qa_batch_results(
    batch_id: str,
    principal: PrincipalDep,
    services: ServicesDep,
    format: Annotated[Literal["jsonl", "csv"], Query()] = "jsonl",
) -> Response:
    """Every question with its answer so far, as JSON Lines or CSV, in question order."""
    batch = await get_batch(services, principal.owner, batch_id)
    jobs = await run_in_threadpool(BatchStore(services.db).jobs, batch.id)
    return Response(render(answers_of(batch, jobs), format), media_type=MEDIA_TYPES[format])


@router.post(
    "/{batch_id}/cancel",
    response_model=QaBatchOut,
    response_model_exclude_none=True,
    responses=error_responses(404),
)
async def cancel_qa_batch(
    batch_id: str, principal: PrincipalDep, services: ServicesDep
) -> QaBatchOut:
    """Cancel every question not answered yet; answered ones keep their answers."""
    batch = await get_batch(services, principal.owner, batch_id)
    await cancel_batch(services, batch)
    return await describe(services, batch, answers=False)
