"""Watching jobs as they run: Server-Sent Events per job, and a WebSocket for many jobs.

Both carry the same events as the job's Redis stream (see `core.events` for their shapes).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Header, WebSocket, WebSocketDisconnect
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from api.cancelling import cancel_job
from api.deps import PrincipalDep, ServicesDep, get_principal
from api.errors import describe_validation_error, error_body, error_response
from api.openapi import COMMON_ERRORS, error_responses
from api.schemas import JobCreate, JobOut
from api.services import Services
from api.streaming import cancel_quietly, event_stream, follow_events, parse_last_event_id
from api.submission import submit_job
from core.apikeys import Principal
from core.errors import ClientError, InvalidRequest, NotFound
from core.models import Job
from core.states import JobStatus

log = logging.getLogger(__name__)

router = APIRouter(tags=["streams"])


async def _owned_job(services: Services, principal: Principal, job_id: str) -> Job:
    job = await run_in_threadpool(services.jobs.get, job_id, principal.owner)
    if job is None:
        raise NotFound(f"No job with id '{job_id}'.", param="job_id")
    return job


@router.get(
    "/v1/jobs/{job_id}/events",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {}}},
        **COMMON_ERRORS,
        **error_responses(404),
    },
)
async def job_events(
    job_id: str,
    principal: PrincipalDep,
    services: ServicesDep,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> StreamingResponse:
    """The job's events as Server-Sent Events, each with `id:` = its sequence number.

    A reader that reconnects with `Last-Event-ID` gets exactly the events after that one; a
    reader that comes after the job ended gets the whole stream replayed. The stream ends after
    the final event; `: keep-alive` comments keep idle connections open through proxies.
    """
    after = parse_last_event_id(last_event_id)
    job = await _owned_job(services, principal, job_id)
    return event_stream(services, job, after)


class _Socket:
    """One WebSocket session: its submissions, subscriptions and a single sender."""

    def __init__(self, websocket: WebSocket, services: Services, principal: Principal) -> None:
        self.websocket = websocket
        self.services = services
        self.principal = principal
        self.outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.followers: dict[str, asyncio.Task[None]] = {}
        # Jobs submitted here that end with the socket unless their client said otherwise.
        self.owned: set[str] = set()

    async def send_loop(self) -> None:
        while True:
            message = await self.outbox.get()
            await self.websocket.send_text(json.dumps(message, ensure_ascii=False))

    def error(self, exc: ClientError, ref: Any = None) -> None:
        body = error_body(exc.error_type, exc.code, exc.message, exc.param, **exc.extra)
        self.outbox.put_nowait({"type": "error", "ref": ref, **body})

    async def handle(self, raw: str) -> None:
        ref = None
        try:
            message = json.loads(raw)
            if not isinstance(message, dict):
                raise InvalidRequest("A message must be a JSON object.", param="message")
            ref = message.get("ref")
            kind = message.get("type")
            if kind == "submit":
                await self.submit(message, ref)
            elif kind == "subscribe":
                await self.subscribe(message, ref)
            elif kind == "cancel":
                await self.cancel(message, ref)
            else:
                raise InvalidRequest(
                    "type must be one of 'submit', 'subscribe', 'cancel'.", param="type"
                )
        except json.JSONDecodeError:
            self.error(InvalidRequest("The message is not valid JSON.", param="message"))
        except ClientError as exc:
            self.error(exc, ref)

    async def submit(self, message: dict[str, Any], ref: Any) -> None:
        try:
            body = JobCreate.model_validate(message.get("job"))
        except ValidationError as exc:
            param, text = describe_validation_error(dict(exc.errors()[0]))
            raise InvalidRequest(text, param=f"job.{param}" if param != "body" else "job") from exc
        job, _ = await submit_job(self.services, self.principal, body, None)
        if message.get("cancel_on_disconnect", True):
            self.owned.add(job.id)
        self.outbox.put_nowait(
            {"type": "accepted", "ref": ref, "job": JobOut.from_job(job).model_dump(mode="json")}
        )
        self.follow(job, 0)

    async def subscribe(self, message: dict[str, Any], ref: Any) -> None:
        job_id = _job_id(message)
        after = parse_last_event_id(str(message.get("after", 0)))
        job = await _owned_job(self.services, self.principal, job_id)
        self.outbox.put_nowait({"type": "subscribed", "ref": ref, "job_id": job_id})
        self.follow(job, after)

    async def cancel(self, message: dict[str, Any], ref: Any) -> None:
        job = await cancel_job(self.services, self.principal.owner, _job_id(message))
        self.outbox.put_nowait({"type": "cancelling", "ref": ref, "job_id": job.id})

    def follow(self, job: Job, after: int) -> None:
        if job.id in self.followers and not self.followers[job.id].done():
            return
        self.followers[job.id] = asyncio.create_task(self._relay(job, after))

    async def _relay(self, job: Job, after: int) -> None:
        async for event in follow_events(self.services, job, after):
            if event is not None:
                self.outbox.put_nowait(event)
                if event["type"] != "delta" and event.get("status") in _FINAL:
                    self.owned.discard(job.id)

    async def close(self) -> None:
        for task in self.followers.values():
            task.cancel()
        for job_id in list(self.owned):
            await cancel_quietly(self.services, self.principal.owner, job_id, "its socket closed")


_FINAL = {status.value for status in JobStatus if status.is_final}


def _job_id(message: dict[str, Any]) -> str:
    job_id = message.get("job_id")
    # No id has a NUL, and PostgreSQL cannot even compare one: it closed the socket there.
    if not isinstance(job_id, str) or not job_id or "\x00" in job_id:
        raise InvalidRequest("job_id must be a job's id.", param="job_id")
    return job_id


@router.websocket("/v1/ws")
async def job_socket(websocket: WebSocket, services: ServicesDep) -> None:
    """Submit jobs and receive their events, several jobs on one socket.

    Client messages: `{"type": "submit", "job": {...}, "ref": any, "cancel_on_disconnect": bool}`,
    `{"type": "subscribe", "job_id", "after"}`, `{"type": "cancel", "job_id"}`. Server messages:
    `accepted` (with the job), `subscribed`, `cancelling`, `error` (with `ref` and `error`), and
    every event of the jobs followed, each tagged with its `job_id`. Jobs submitted on a socket
    are cancelled when it closes, unless `cancel_on_disconnect` was false.
    """
    try:
        principal = await get_principal(websocket, services)
    except ClientError as exc:
        response = error_response(exc.status_code, exc.error_type, exc.code, exc.message)
        if "websocket.http.response" in websocket.scope.get("extensions", {}):
            await websocket.send_denial_response(response)
        else:
            await websocket.close(code=1008, reason=exc.code)
        return
    await websocket.accept()
    session = _Socket(websocket, services, principal)
    sender = asyncio.create_task(session.send_loop())
    try:
        while True:
            await session.handle(await websocket.receive_text())
    except WebSocketDisconnect:
        pass
    finally:
        sender.cancel()
        await session.close()
