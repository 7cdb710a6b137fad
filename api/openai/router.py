"""The OpenAI-compatible surface: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Each completion is an ordinary job on the caller's tier — same validation, quotas and queues as
`POST /v1/jobs` — that the request then waits for (or streams) and answers in OpenAI's format.
The openai SDKs work against it with `base_url=<inferq>/v1` and an inferq key as `api_key`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.catalog import check_models, served_adapters, serving_workers
from api.deps import PrincipalDep, ServicesDep
from api.openai.chat_prompt import render_chat
from api.openai.protocol import (
    ChatCompletionRequest,
    CompletionKind,
    CompletionRequest,
    check_model,
    model_card,
)
from api.openai.serving import completion_response, completion_stream, wait_for_job
from api.openapi import COMMON_ERRORS, error_responses
from api.schemas import JobCreate
from api.services import Services
from api.submission import submit_job
from core.apikeys import Principal

router = APIRouter(prefix="/v1", tags=["openai"], responses=COMMON_ERRORS)

_STREAM_DOC: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "with stream=true"},
    **error_responses(404, 409, 413, 429, 500, 504),
}


async def _cards(services: Services) -> list[dict[str, Any]]:
    workers = await serving_workers(services)
    cards = []
    for name in services.models.names():
        info = services.models.of(name)
        serving = sorted(worker for worker, what in workers.items() if what.model == name)
        cards.append(model_card(name, info.created, info.max_model_len, workers=serving))
    model = services.model
    first = cards[0]["workers"]
    with_adapters = [name for name in first if workers[name].adapters]
    adapters = [
        model_card(
            adapter.name,
            model.created,
            model.max_model_len,
            parent=model.name,
            workers=with_adapters,
        )
        for adapter in await served_adapters(services)
    ]
    return [*cards, *adapters]


@router.get("/models")
async def list_models(_principal: PrincipalDep, services: ServicesDep) -> dict[str, Any]:
    """The served models and the first one's registered LoRA adapters, in OpenAI's list
    format, each with the live workers that serve it (`workers`)."""
    return {"object": "list", "data": await _cards(services)}


@router.get("/models/{model_id:path}", responses=error_responses(404))
async def retrieve_model(
    model_id: str, _principal: PrincipalDep, services: ServicesDep
) -> dict[str, Any]:
    """A served model or an adapter; 404 `model_not_found` for any other id."""
    cards = {card["id"]: card for card in await _cards(services)}
    check_model(services.model.name, model_id, cards)
    return cards[model_id]


@router.post("/completions", responses=_STREAM_DOC)
async def create_completion(
    body: CompletionRequest, request: Request, principal: PrincipalDep, services: ServicesDep
) -> Response:
    """Continue a prompt: a job on the caller's tier, answered as an OpenAI completion."""
    job_body = body.to_job()
    return await _serve(
        services, principal, request, job_body, "text_completion", body.stream, body.include_usage
    )


@router.post("/chat/completions", responses=_STREAM_DOC)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, principal: PrincipalDep, services: ServicesDep
) -> Response:
    """The assistant's reply to `messages` (rendered with the model's chat template)."""
    await check_models(services, [body.model])  # before the prompt is rendered
    prompt = render_chat(services.models.of(body.model), body.message_dicts())
    job_body = body.to_job(prompt)
    return await _serve(
        services, principal, request, job_body, "chat.completion", body.stream, body.include_usage
    )


async def _serve(
    services: Services,
    principal: Principal,
    request: Request,
    job_body: JobCreate,
    kind: CompletionKind,
    stream: bool | None,
    include_usage: bool,
) -> Response:
    job, _ = await submit_job(services, principal, job_body, None)
    model = job.model or services.model.name
    if stream:
        return completion_stream(services, job, principal.owner, model, kind, include_usage)
    final = await wait_for_job(services, request, job, principal.owner)
    return completion_response(final, model, kind)
