"""Serving an OpenAI-style request through a job: wait for its end, or stream its events.

Both follow the job's event stream as `GET /v1/jobs/{id}/events` does (`api.streaming`), and a
client that goes away before the job ends cancels it, as a streaming `POST /v1/jobs` does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from api.errors import error_body
from api.openai.protocol import (
    SSE_DONE,
    ChunkFormat,
    CompletionKind,
    completion_body,
    created_at,
    job_failure,
    sse_data,
)
from api.services import Services
from api.streaming import SSE_HEARTBEAT, cancel_quietly, follow_events
from core.events import is_final
from core.models import Job
from core.states import JobStatus

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499
"""The status logged for a call whose client left before its answer (nginx's convention)."""


class StreamDiverged(Exception):
    """A job's rerun wrote other text than its lost run had already streamed to the client."""


class StreamedText:
    """The text a client has been sent, kept whole across a job's attempts.

    A job whose worker was lost runs again from the start (a `running` event with a higher
    attempt); its deltas then repeat text the client already has. They are held back until
    they pass what was sent, then only the new text goes out. A rerun that wrote something
    else (sampling without a seed) cannot be taken back: `StreamDiverged`.
    """

    def __init__(self) -> None:
        self.sent = ""
        self.attempt: int | None = None
        self.attempt_text = ""

    def feed(self, event: dict[str, Any]) -> str:
        """The new text this event brings the client ('' for none)."""
        attempt = event.get("attempt")
        if event["type"] not in ("status", "delta") or not isinstance(attempt, int):
            return ""
        if self.attempt is None or attempt > self.attempt:
            self.attempt, self.attempt_text = attempt, ""
        if event["type"] != "delta" or attempt < self.attempt:
            return ""  # a status event, or a late delta of a void attempt
        caught_up = len(self.attempt_text) >= len(self.sent)
        self.attempt_text += event["text"]
        if caught_up:  # the usual case: every delta is new text
            self.sent = self.attempt_text
            return str(event["text"])
        common = min(len(self.attempt_text), len(self.sent))
        if self.attempt_text[:common] != self.sent[:common]:
            raise StreamDiverged
        new = self.attempt_text[len(self.sent) :]
        if new:
            self.sent = self.attempt_text
        return new


async def _final_event(services: Services, job: Job) -> dict[str, Any] | None:
    async for event in follow_events(services, job, 0, watch=False):
        if event is not None and is_final(event):
            return event
    return None


async def _client_gone(request: Request) -> None:
    """Return once the client has disconnected (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_for_job(services: Services, request: Request, job: Job, owner: str) -> Job | None:
    """The job once it has ended; None if the client went away first (the job is cancelled)."""
    waiter = asyncio.ensure_future(_final_event(services, job))
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        waiter.cancel()
    if not waiter.done() or waiter.cancelled():
        if not watcher.cancelled() and watcher.exception() is not None:
            log.warning("job %s: lost its client", job.id, exc_info=watcher.exception())
        with anyio.CancelScope(shield=True):
            await cancel_quietly(services, owner, job.id, "its client disconnected")
        return None
    waiter.result()  # re-raises what ended the wait, if anything went wrong
    final = await run_in_threadpool(services.jobs.get, job.id, owner)
    assert final is not None
    return final


def completion_response(job: Job | None, model: str, kind: CompletionKind) -> Response:
    """The answer to a waiting call: the completion, or the error its job ended with."""
    if job is None:
        body = error_body(
            "invalid_request_error", "client_closed", "The client closed the request.", openai=True
        )
        return JSONResponse(body, CLIENT_CLOSED)
    status = JobStatus(job.status)
    headers = {"Location": f"/v1/jobs/{job.id}"}
    if status is JobStatus.SUCCEEDED:
        return JSONResponse(completion_body(job, model, kind), headers=headers)
    failure = job_failure(job.id, status, job.error_code, job.error_message)
    headers["x-should-retry"] = str(failure.retry).lower()
    return JSONResponse(failure.body, failure.status_code, headers=headers)


def completion_stream(
    services: Services, job: Job, owner: str, model: str, kind: CompletionKind, include_usage: bool
) -> StreamingResponse:
    """The job's text as OpenAI chunks over SSE, then the finish (or error) chunk and [DONE].

    A client that goes away before the job ends cancels it.
    """
    chunks = ChunkFormat(kind, job.id, created_at(job), model, include_usage)

    async def frames() -> AsyncIterator[str]:
        ended = False
        text = StreamedText()
        try:
            opening = chunks.opening()
            if opening is not None:
                yield opening
            async for event in follow_events(services, job, 0):
                if event is None:
                    yield SSE_HEARTBEAT
                elif is_final(event):
                    ended = True
                    for frame in _final_frames(chunks, job.id, event):
                        yield frame
                    return
                else:
                    try:
                        new = text.feed(event)
                    except StreamDiverged:
                        ended = True
                        yield _diverged_frame(job.id)
                        yield SSE_DONE
                        return
                    if new:
                        yield chunks.text(new)
        finally:
            if not ended:
                with anyio.CancelScope(shield=True):
                    await cancel_quietly(services, owner, job.id, "its stream closed")

    return StreamingResponse(
        frames(),
        media_type="text/event-stream",
        headers={
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            "Location": f"/v1/jobs/{job.id}",
        },
    )


def _final_frames(chunks: ChunkFormat, job_id: str, event: dict[str, Any]) -> list[str]:
    status = JobStatus(event["status"])
    if status is not JobStatus.SUCCEEDED:
        failure = job_failure(job_id, status, event.get("error_code"), None)
        return [sse_data(failure.body), SSE_DONE]
    frames = [chunks.finish(event.get("finish_reason"))]
    if chunks.include_usage:
        counts = event.get("usage") or {}
        frames.append(chunks.usage(counts.get("prompt_tokens"), counts.get("completion_tokens")))
    return [*frames, SSE_DONE]


def _diverged_frame(job_id: str) -> str:
    message = (
        f"Job '{job_id}' lost its worker and was run again, and the rerun wrote other text than "
        f"was already streamed; it goes on, and its final text will be at /v1/jobs/{job_id}."
    )
    return sse_data(error_body("server_error", "stream_restarted", message, openai=True))
