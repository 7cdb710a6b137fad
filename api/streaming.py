"""Following a job's event stream from the API: replay, then live, then the final event.

The per-job Redis stream is the source (see `core.events`); the database is the judge. A job
that ended while its final event was lost (Redis restarted, the stream expired) still gets a
final event, rebuilt from its row, so no reader ever waits forever.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import redis.exceptions
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.cancelling import cancel_job
from api.event_relay import REDIS_PATIENCE_S
from api.services import Services
from core.errors import InvalidRequest, JobAlreadyFinal
from core.events import is_final, read_events, watch_job
from core.models import Job
from core.states import JobStatus, final_event_type

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
"""How often an idle stream sends a keep-alive (and rechecks the job's row)."""

_RETRY_EVERY_S = 0.5


def parse_last_event_id(value: str | None) -> int:
    """The sequence number a reader has seen (0: none); InvalidRequest if it is not one of ours."""
    if value is None or value.strip() == "":
        return 0
    text = value.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise InvalidRequest(
            "Last-Event-ID must be the id of an event of this stream (a whole number).",
            param="Last-Event-ID",
        )
    return int(text)


def final_event_from_row(job: Job, seq: int) -> dict[str, Any]:
    """The final event of a job whose stream lost it, rebuilt from the job's row."""
    status = JobStatus(job.status)
    return {
        "seq": seq,
        "job_id": job.id,
        "type": final_event_type(status),
        "status": status.value,
        "finish_reason": job.finish_reason,
        "error_code": job.error_code,
        "usage": {"prompt_tokens": job.prompt_tokens, "completion_tokens": job.completion_tokens},
    }


async def follow_events(
    services: Services,
    job: Job,
    after_seq: int,
    *,
    heartbeat_s: float = HEARTBEAT_S,
    watch: bool = True,
) -> AsyncIterator[dict[str, Any] | None]:
    """The job's events after `after_seq` up to its final one; None when a heartbeat is due.

    With `watch`, the job's worker publishes its deltas live (see `workers.streams`); without,
    they may come as one delta at the end, which is all a reader waiting for the result needs.
    Live events come through the process's `api.event_relay.EventRelay`.
    """
    last = after_seq
    # A job already final: replay what is there without waiting.
    if JobStatus(job.status).is_final:
        while True:
            events = await _read(services, job.id, last)
            for event in events:
                last = event["seq"]
                yield event
                if is_final(event):
                    return
            if not events:
                yield final_event_from_row(job, last + 1)
                return
    if watch:
        await watch_job(services.redis, job.id, services.settings.job_key_ttl_s)
    async with services.relay.follow(job.id, last) as follow:
        idle_since = time.monotonic()
        while True:
            events = await follow.next(heartbeat_s - (time.monotonic() - idle_since))
            for event in events:
                last = event["seq"]
                yield event
                if is_final(event):
                    return
            if events:
                idle_since = time.monotonic()
                continue
            if time.monotonic() - idle_since >= heartbeat_s:
                idle_since = time.monotonic()
                current = await run_in_threadpool(services.jobs.get, job.id)
                if current is not None and JobStatus(current.status).is_final:
                    # One more read: the final event may have landed since the last one.
                    events = await _read(services, job.id, last)
                    for event in events:
                        last = event["seq"]
                        yield event
                        if is_final(event):
                            return
                    yield final_event_from_row(current, last + 1)
                    return
                yield None


async def _read(services: Services, job_id: str, after_seq: int) -> list[dict[str, Any]]:
    """`read_events`, tried again while Redis fails for up to `REDIS_PATIENCE_S` (the relay
    waits as long for live events).

    Reading is safe to repeat, and a reader would otherwise lose its stream to a moment's
    outage: a connection dropped, or Redis (or this process) starved of CPU past the socket's
    timeout.
    """
    failing_since: float | None = None
    while True:
        try:
            return await read_events(services.redis, job_id, after_seq)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
                log.warning("job %s: reading its events failed (%s); trying again", job_id, exc)
            if now - failing_since >= REDIS_PATIENCE_S:
                raise
            await anyio.sleep(_RETRY_EVERY_S)


def sse_frame(event: dict[str, Any]) -> str:
    """One Server-Sent Event: its id is the event's sequence number, its name the event type."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"id: {event['seq']}\nevent: {event['type']}\ndata: {data}\n\n"


SSE_HEARTBEAT = ": keep-alive\n\n"


def event_stream(
    services: Services,
    job: Job,
    after_seq: int,
    *,
    cancel_owner: str | None = None,
    headers: dict[str, str] | None = None,
) -> StreamingResponse:
    """The job's events after `after_seq` as an SSE response.

    With `cancel_owner`, a client that goes away before the final event cancels the job.
    """

    async def frames() -> AsyncIterator[str]:
        ended = False
        try:
            async for event in follow_events(services, job, after_seq):
                if event is None:
                    yield SSE_HEARTBEAT
                    continue
                ended = is_final(event)
                yield sse_frame(event)
        finally:
            if not ended and cancel_owner is not None:
                with anyio.CancelScope(shield=True):
                    await cancel_quietly(services, cancel_owner, job.id, "its stream closed")

    return StreamingResponse(
        frames(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
    )


async def cancel_quietly(services: Services, owner: str, job_id: str, why: str) -> None:
    """Cancel a job its client has abandoned; nothing if it has ended meanwhile."""
    try:
        await cancel_job(services, owner, job_id)
        log.info("job %s cancelled: %s", job_id, why)
    except JobAlreadyFinal:
        pass
    except Exception:
        log.warning("job %s: could not cancel it after %s", job_id, why, exc_info=True)
