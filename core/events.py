"""A job's events: numbered, kept in a per-job stream and published live, in one atomic step.

Each event is a JSON object with `seq` (1, 2, ...), `job_id` and `type`:

- `status`: a state change (`status`; `attempt` when a run starts). A `running` event with a
  higher `attempt` than before means an earlier run was lost. With `resumes_after` (an event
  number), the new run continues the text of the deltas up to that event — its worker read
  them and generates only the rest; without, the earlier deltas are void and the text starts
  again (`streamed_text` folds a stream by this rule).
- `delta`: the `text` made since the previous delta of the same `attempt`, its `tokens`, and
  `at`, when the engine made its first token (Unix time).
- one final event — `done`, `error`, `cancelled` or `timed_out` — carrying `status`, `usage`
  and `error_code`; nothing follows it.

The stream entry of event `seq` has the id `0-<seq>` and holds the event without `seq` (the
readers here add it), so "everything after event N" is an XREAD from `0-N`, and a job has ended
when its stream's last entry is a final event (`ended_jobs`). A final event's job id is also
published on `keys.FINAL_EVENTS_CHANNEL`, which is what waits for a job's end listen to (see
`api.final_events`; one message names every job a call ended). Publishing a final event also
takes the job off its key's concurrent-jobs set (see `core.quotas`), whichever process ends
the job.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio as aioredis

from core import keys

# Numbering, storing and publishing happen in one script so that two publishers (the API
# cancelling a queued job, a worker finishing it) can never give out the same number. One call
# publishes any number of events: KEYS holds 3 keys per event, ARGV the TTL and then 3 values per
# event (body, kind, job id). A worker publishes a whole engine step's deltas in one call, not one
# call per job. Redis numbers the entries (`XADD 0-*`, Redis 7.0); the entry keeps the body as
# sent and readers take `seq` from its id. A stream's TTL restarts when the stream is made and
# with each status or final event, once per call; a delta leaves it (a running job's worker
# restarts it, `workers.runner`). A call's final events wake the waits for job ends with one
# message: their job ids, space-separated.
_PUBLISH_SCRIPT = """
local ttl = ARGV[1]
local restarted, ended = {}, {}
for i = 0, #KEYS / 3 - 1 do
  local stream, channel, quota = KEYS[3*i+1], KEYS[3*i+2], KEYS[3*i+3]
  local body, kind, job_id = ARGV[3*i+2], ARGV[3*i+3], ARGV[3*i+4]
  local id = redis.call('XADD', stream, '0-*', 'e', body)
  local seq = string.sub(id, 3)
  if not restarted[stream] and (kind ~= 'delta' or seq == '1') then
    restarted[stream] = true
    redis.call('EXPIRE', stream, ttl)
  end
  local payload = '{"seq":' .. seq .. ',' .. string.sub(body, 2)
  redis.call('PUBLISH', channel, payload)
  if kind == 'final' then
    -- a final event: the waits for the job's end listen to one channel for every job so that
    -- deltas do not wake them (`ended_jobs` tells whether a job ended before they began); the
    -- job no longer counts against its key's concurrent jobs
    table.insert(ended, job_id)
    local active = redis.call('GET', quota)
    if active then
      redis.call('ZREM', active, job_id)
      redis.call('DEL', quota)
    end
  end
end
if #ended > 0 then redis.call('PUBLISH', FINAL_EVENTS_CHANNEL, table.concat(ended, ' ')) end
return #KEYS / 3
""".replace("FINAL_EVENTS_CHANNEL", f"'{keys.FINAL_EVENTS_CHANNEL}'")

MAX_EVENTS_PER_CALL = 256
"""Events per script call: Redis runs a script alone, so very long ones would stall others."""


FINAL_EVENT_TYPES = frozenset({"done", "error", "cancelled", "timed_out"})


Event = tuple[str, str, dict[str, Any]]
"""One event to publish: (job id, type, fields)."""


def _script_call(events: Sequence[Event], ttl_s: int) -> tuple[list[str], list[Any]]:
    """The script's keys and arguments for publishing `events` in order."""
    script_keys: list[str] = []
    args: list[Any] = [ttl_s]
    for job_id, event_type, fields in events:
        script_keys += [
            keys.job_event_stream(job_id),
            keys.job_events_channel(job_id),
            keys.job_quota_set(job_id),
        ]
        args += [encode_event(job_id, event_type, **fields), _kind(event_type), job_id]
    return script_keys, args


def _kind(event_type: str) -> str:
    """How the script treats an event: `final`, `delta`, or `status` (any other type)."""
    if event_type in FINAL_EVENT_TYPES:
        return "final"
    return "delta" if event_type == "delta" else "status"


def encode_event(job_id: str, event_type: str, **fields: Any) -> str:
    """The event body, without its sequence number (the script adds it)."""
    return json.dumps({"job_id": job_id, "type": event_type, **fields}, separators=(",", ":"))


def is_final(event: dict[str, Any]) -> bool:
    """Whether this event ends its job's stream."""
    return event.get("type") in FINAL_EVENT_TYPES


class EventPublisher:
    """Publishes job events from a synchronous process (a worker, the CLI)."""

    def __init__(self, client: redis.Redis, ttl_s: int) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self._script = client.register_script(_PUBLISH_SCRIPT)

    def publish(
        self,
        job_id: str,
        event_type: str,
        *,
        client: redis.client.Pipeline | None = None,
        **fields: Any,
    ) -> None:
        """Append one event to the job's stream and publish it (or queue that on a pipeline)."""
        self.publish_many([(job_id, event_type, fields)], client=client)

    def publish_many(
        self, events: Sequence[Event], *, client: redis.client.Pipeline | None = None
    ) -> None:
        """Publish the events in order, in as few script calls as `MAX_EVENTS_PER_CALL` allows."""
        for start in range(0, len(events), MAX_EVENTS_PER_CALL):
            script_keys, args = _script_call(
                events[start : start + MAX_EVENTS_PER_CALL], self.ttl_s
            )
            self._script(keys=script_keys, args=args, client=client)

    def restart_ttls(self, job_ids: Sequence[str], client: redis.client.Pipeline) -> None:
        """Restart the TTL of these running jobs' streams, which their deltas leave as it is."""
        for job_id in job_ids:
            client.expire(keys.job_event_stream(job_id), self.ttl_s)


class AsyncEventPublisher:
    """Publishes job events from the API's event loop."""

    def __init__(self, client: aioredis.Redis, ttl_s: int) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self._script = client.register_script(_PUBLISH_SCRIPT)

    async def publish(self, job_id: str, event_type: str, **fields: Any) -> None:
        """Append one event to the job's stream and publish it."""
        script_keys, args = _script_call([(job_id, event_type, fields)], self.ttl_s)
        await self._script(keys=script_keys, args=args)


async def watch_job(client: aioredis.Redis, job_id: str, ttl_s: int) -> None:
    """Ask for the job's deltas live: its worker holds back those of unwatched jobs.

    The flag tells a worker that starts the job later; the message tells one running it now,
    which then publishes the text so far as one delta, and every delta after it.
    """
    pipe = client.pipeline(transaction=False)
    pipe.set(keys.job_watched(job_id), "1", ex=ttl_s)
    pipe.publish(keys.WATCH_CHANNEL, job_id)
    await pipe.execute()


def stream_id(seq: int) -> str:
    """The stream entry id of event `seq` (0 stands for "before the first event")."""
    return f"0-{seq}"


async def read_events(
    client: aioredis.Redis, job_id: str, after_seq: int, *, count: int = 500
) -> list[dict[str, Any]]:
    """The job's events after `after_seq`, oldest first, as far as they go now (live readers
    wait through `api.event_relay`)."""
    reply = await client.xread({keys.job_event_stream(job_id): stream_id(after_seq)}, count=count)
    return [event for _, event in _entries(reply)]


async def ended_jobs(client: aioredis.Redis, job_ids: Sequence[str]) -> set[str]:
    """Those of the jobs whose stream ends with a final event, read in one round trip."""
    pipe = client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.xrevrange(keys.job_event_stream(job_id), count=1)
    replies = await pipe.execute() if job_ids else []
    return {
        job_id
        for job_id, last in zip(job_ids, replies, strict=True)
        if any(is_final(event) for event in parse_events(last))
    }


def streamed_text(events: Sequence[dict[str, Any]]) -> tuple[str, int]:
    """The text, and its tokens, that these events of one job (in order) add up to for a reader.

    Only deltas of the current run count, after the deltas of earlier runs that it resumes.
    """
    kept: list[dict[str, Any]] = []
    attempt = 0
    for event in events:
        if event["type"] == "status" and event.get("status") == "running" and "attempt" in event:
            if event["attempt"] != attempt:
                after = event.get("resumes_after")
                kept = [] if after is None else [d for d in kept if d["seq"] <= after]
                attempt = event["attempt"]
        elif event["type"] == "delta" and event["attempt"] == attempt:
            kept.append(event)
    return "".join(d["text"] for d in kept), sum(d["tokens"] for d in kept)


def parse_events(xrange_reply: Any) -> list[dict[str, Any]]:
    """The events of an XRANGE reply on a job's stream (`keys.job_event_stream`)."""
    return [event for _, event in _entries([(None, xrange_reply or [])])]


def _entries(reply: Any) -> list[tuple[str, dict[str, Any]]]:
    """(entry id, event) pairs from an XREAD reply on one stream."""
    pairs: list[tuple[str, dict[str, Any]]] = []
    for _stream, entries in reply or []:
        for entry_id, fields in entries:
            raw = fields.get(b"e", fields.get("e"))
            entry = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            pairs.append((entry, {"seq": int(entry.partition("-")[2]), **json.loads(raw)}))
    return pairs
