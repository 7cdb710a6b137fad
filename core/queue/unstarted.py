"""Handing on the jobs a worker took from the queue and never started.

A worker that takes a job's message leaves it recorded in Redis as unacknowledged (kombu's
`unacked` hash: the message, its exchange and routing key; `unacked_index`: when it was taken)
until the job has ended, and starts the job at once: a live worker holds a queued job's message
for milliseconds. A worker that dies, is cut off or freezes right after a take holds messages
whose jobs are still queued in the database. The lease reaper does not see those jobs (they
never ran), and kombu's own visibility restore returns their messages only long after
(`core.queue.app.REDELIVER_UNACKED_AFTER_S`, on a sweep some worker runs every 100 s).

`UnstartedJobs.hand_on` looks at each message when it turns `after_s` old (the scheduler sets
it to how long a lost worker's running jobs wait to be handed on), and again while a live
worker's lease defers it, and puts it back at the front of its queue, marked redelivered as
kombu's restore marks it and under a delivery tag of its own, if its job is still queued.
A live worker that was merely slow to start it gets a duplicate: of the two takers, the one that
finds the job's lease held or the job running skips it. A worker that froze after claiming the
job's lease, before marking it running, leaves a lease on a queued job: it goes with the move
when its worker has lost its name, and defers the move while the worker holds it. Should the
frozen worker wake, it finds the job started at a later attempt and skips it
(`core.jobs.JobStore.start_attempts`). A worker whose clock lags the scheduler's by more than
`after_s` records takes that this never looks at: kombu's restore is their fallback.

The unacked records are kombu's Redis transport's storage, not its public API: the names and the
entry's shape this reads are listed in `core.celery_compat.PRIVATE_NAMES`. An entry of another
shape is left to kombu's restore.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass

import redis
from kombu.transport.redis import Channel

from core import keys
from core.jobs import JobStore
from core.queue.app import RUN_JOB_TASK
from core.queue.wake import WAKE_LUA
from core.states import JobStatus
from core.workernames import lease_holder

log = logging.getLogger(__name__)

UNACKED_KEY: str = Channel.unacked_key
UNACKED_INDEX_KEY: str = Channel.unacked_index_key

# KEYS: the unacked hash, its index and the job's lease. ARGV: the delivery tag, its entry as
# read, its queue, the message to push and the lease as read ('': none). 0: nothing moved, the
# entry is gone (acked, or moved by another scheduler); 2: nothing moved, the lease changed (a
# worker claimed the job since); 1: moved (waking a waiting worker, `core.queue.wake`), and the
# lease of the lost worker deleted.
_RESTORE = (
    WAKE_LUA
    + """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
local lease = redis.call('GET', KEYS[3])
if (lease or '') ~= ARGV[5] then return 2 end
if lease then redis.call('DEL', KEYS[3]) end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('RPUSH', ARGV[3], ARGV[4])
wake(ARGV[3], 1)
return 1
"""
)


@dataclass(frozen=True)
class TakenMessage:
    """A `run_job` message recorded as unacknowledged."""

    tag: str
    entry: bytes
    """The unacked hash's entry, as read."""
    job_id: str
    queue: str
    """Where it goes back: the queue it was sent to (its routing key)."""
    redelivered: bytes
    """The message to push back, marked redelivered."""


def read_entry(tag: str, entry: bytes) -> TakenMessage | None:
    """The taken message an unacked entry holds (None: not a `run_job` message as inferq sends
    them: to the default exchange, with no priority, whose queue is its routing key)."""
    try:
        payload, exchange, routing_key = json.loads(entry)
        headers, properties = payload["headers"], payload["properties"]
        body = json.loads(base64.b64decode(payload["body"]))
        job_id = body[0][0]
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    plain = exchange == "" and properties.get("priority") in (0, None)
    if not plain or headers.get("task") != RUN_JOB_TASK or not isinstance(job_id, str):
        return None
    if not isinstance(routing_key, str) or not routing_key:
        return None
    headers["redelivered"] = True
    properties["delivery_info"]["redelivered"] = True
    # A tag of its own: the worker that took the original may still ack it (it was frozen, or
    # ends its skip), which must not remove the next taker's record of this copy.
    properties["delivery_tag"] = str(uuid.uuid4())
    return TakenMessage(tag, entry, job_id, routing_key, json.dumps(payload).encode())


class UnstartedJobs:
    """Puts back the messages of jobs taken more than `after_s` ago and still queued.

    Each message is looked at when it turns `after_s` old: a job running by then is the lease
    reaper's, and one ended leaves nothing to do. A worker claims a job's lease before it marks
    the job running, so a queued job may have a lease: one taken by a process that no longer
    holds its worker name is deleted with the move (else the next worker would find the job
    held and skip it); one of a live worker, which is starting the job, defers the message to
    the next call.
    """

    def __init__(self, client: redis.Redis, store: JobStore, after_s: float) -> None:
        self.redis = client
        self.store = store
        self.after_s = after_s
        self._seen_to = -math.inf  # every message taken up to this time has been looked at
        self._again: set[str] = set()  # tags whose jobs a live worker held the lease of
        self._restore = client.register_script(_RESTORE)

    def hand_on(self, now: float | None = None) -> list[str]:
        """Put back the messages of unstarted jobs that turned `after_s` old since the last
        call (at the first, every such message); the ids of their jobs.

        What it looked at is remembered only once the call has succeeded: a call that fails
        (Redis or the database out) leaves the same messages to the next.
        """
        until = (time.time() if now is None else now) - self.after_s
        tags = list(self._again)
        if until > self._seen_to:
            since = "-inf" if self._seen_to == -math.inf else f"({self._seen_to!r}"
            found: list[bytes | str] = self.redis.zrangebyscore(UNACKED_INDEX_KEY, since, until)  # type: ignore[assignment]
            tags += [_text(tag) for tag in found]
        handed_on: list[str] = []
        again: set[str] = set()
        if tags:
            entries = self.redis.hmget(UNACKED_KEY, tags)
            taken = [
                message
                for tag, entry in zip(tags, entries, strict=True)
                if entry is not None and (message := read_entry(tag, _bytes(entry))) is not None
            ]
            handed_on, again = self._restore_queued(taken)
        self._seen_to = max(self._seen_to, until)
        self._again = again
        return handed_on

    def _restore_queued(self, taken: list[TakenMessage]) -> tuple[list[str], set[str]]:
        """Put back those whose jobs are queued: the jobs' ids, and the tags to look at again."""
        if not taken:
            return [], set()
        jobs = self.store.get_many(list({message.job_id for message in taken}))
        queued = [
            message
            for message in taken
            if (job := jobs.get(message.job_id)) is not None
            and job.status == JobStatus.QUEUED.value
        ]
        if not queued:
            return [], set()
        leases = self.redis.mget([keys.job_lease(message.job_id) for message in queued])
        live = self._live_claims()
        handed_on, again = [], set()
        for message, lease in zip(queued, leases, strict=True):
            if lease is not None and lease_holder(lease) in live:
                again.add(message.tag)
                continue
            moved = self._restore(
                keys=[UNACKED_KEY, UNACKED_INDEX_KEY, keys.job_lease(message.job_id)],
                args=[message.tag, message.entry, message.queue, message.redelivered, lease or ""],
            )
            if moved == 2:
                again.add(message.tag)
            elif moved:
                log.warning(
                    "job %s: taken from %s over %gs ago and not started; back in its queue",
                    message.job_id,
                    message.queue,
                    self.after_s,
                    extra={"job_id": message.job_id},
                )
                handed_on.append(message.job_id)
        return handed_on, again

    def _live_claims(self) -> set[str]:
        """The claim tokens of the workers that hold their names now."""
        names = sorted(_text(name) for name in self.redis.smembers(keys.WORKERS_SET))
        claims = self.redis.mget([keys.worker_name_claim(name) for name in names]) if names else []
        return {_text(claim) for claim in claims if claim is not None}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value
