"""Token streams: the engine's per-step deltas, published to Redis off the engine's loop.

The engine hands over every delta made in one step as one list (`publish_step`); a publisher
thread writes them in one pipelined round trip. When Redis is slower than the engine, steps
that queued up meanwhile are merged: a job's consecutive deltas become one event, so the cost
of streaming stays bounded by Redis round trips, never by tokens.

Deltas go out live only for **watched** jobs: ones a reader follows (the API marks a job it
streams, see `core.events.watch_job`, and the worker also watches jobs with pub/sub
subscribers). An unwatched job's deltas are merged here instead, and published as one delta
when a reader arrives (the text so far, then every delta live) or when the job ends, before
its final event. Either way a job's stream ends with its whole text; most jobs are only
polled, and for them streaming costs one event, not one per engine step.

Deltas that Redis did not take (it is restarting, or failing over to a replica) are kept and
sent, merged, before anything newer; a job's end waits up to `UNSENT_RETRY_S` for them to go
out before its final event. A reader that resumes by Last-Event-ID after the outage gets the
text it missed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass

import redis

from core.events import Event, EventPublisher
from core.states import JobStatus
from workers.generation import Delta

log = logging.getLogger(__name__)

UNSENT_RETRY_S = 20.0
"""How long a job's end waits for its deltas that Redis did not take (within `flush`'s 30 s)."""


@dataclass(frozen=True)
class _Watch:
    """A reader follows this job from now on."""

    job_id: str


@dataclass(frozen=True)
class _Flush:
    """Publish everything queued so far, and the held deltas of `job_ids` (None: all jobs)."""

    job_ids: frozenset[str] | None
    done: Future[None]


_Item = list[Delta] | list[Event] | _Watch | _Flush


class DeltaPublisher:
    """Publishes deltas in the order they were made, one pipeline per batch of steps."""

    def __init__(self, publisher: EventPublisher, unsent_retry_s: float = UNSENT_RETRY_S) -> None:
        self.publisher = publisher
        self.unsent_retry_s = unsent_retry_s
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self.events_published = 0
        # Owned by the publisher thread: jobs running here (announced, or making deltas) and
        # not yet ended, those of them that are watched, and unwatched jobs' merged deltas.
        self._live: set[str] = set()
        self._watched: set[str] = set()
        self._held: dict[tuple[str, int], Delta] = {}
        self._unsent: list[Delta] = []  # published, but Redis did not take them
        threading.Thread(target=self._loop, name="inferq-deltas", daemon=True).start()

    def publish_step(self, deltas: list[Delta]) -> None:
        """Queue one step's deltas; never blocks (the engine's loop calls this)."""
        if deltas:
            self._queue.put(deltas)

    def publish_events(self, events: list[Event]) -> None:
        """Queue other events (job id, type, fields), in order with the deltas around them."""
        if events:
            self._queue.put(events)

    def watch(self, job_id: str) -> None:
        """Publish the job's deltas live from now on, the text held so far first.

        Ignored for a job that is not running here (its start announced, not yet flushed).
        """
        self._queue.put(_Watch(job_id))

    def flush(self, job_ids: Collection[str] | None = None, timeout_s: float = 30.0) -> None:
        """Wait until every delta queued before this call has been published (or dropped).

        Held deltas of `job_ids` (of every job if None) are published too, and those jobs are
        forgotten: call it when they end, before their final events.
        """
        done: Future[None] = Future()
        self._queue.put(_Flush(None if job_ids is None else frozenset(job_ids), done))
        done.result(timeout=timeout_s)

    def _loop(self) -> None:
        while True:
            items = [self._queue.get()]
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            pending: list[Delta] = []
            for item in items:
                if isinstance(item, list) and item and isinstance(item[0], Delta):
                    pending.extend(self._hold_unwatched(item))
                    continue
                self._publish(pending)  # what came before goes out first
                pending = []
                if isinstance(item, _Flush):
                    self._publish(self._release(item.job_ids))
                    deadline = time.monotonic() + self.unsent_retry_s
                    while self._unsent and time.monotonic() < deadline:
                        time.sleep(0.5)
                        self._publish([])
                    item.done.set_result(None)
                elif isinstance(item, _Watch):
                    if item.job_id in self._live and item.job_id not in self._watched:
                        self._watched.add(item.job_id)
                        self._publish(self._release(frozenset({item.job_id}), forget=False))
                else:
                    self._note_starts(item)  # type: ignore[arg-type]
                    self._publish_events(item)  # type: ignore[arg-type]
            self._publish(pending)

    def _hold_unwatched(self, deltas: list[Delta]) -> list[Delta]:
        """The deltas of watched jobs; the others are merged into what their jobs hold."""
        live: list[Delta] = []
        for delta in deltas:
            self._live.add(delta.job_id)
            if delta.job_id in self._watched:
                live.append(delta)
                continue
            key = (delta.job_id, delta.attempt)
            held = self._held.get(key)
            if held is None:
                self._held[key] = Delta(
                    delta.job_id, delta.attempt, delta.text, delta.tokens, delta.at
                )
            else:
                held.text += delta.text
                held.tokens += delta.tokens
        return live

    def _release(self, job_ids: frozenset[str] | None, *, forget: bool = True) -> list[Delta]:
        """Take the held deltas of these jobs (all if None); `forget` ends their tracking."""
        chosen = [key for key in self._held if job_ids is None or key[0] in job_ids]
        released = [self._held.pop(key) for key in chosen]
        if forget:
            ended = set(self._live) if job_ids is None else job_ids
            self._live -= ended
            self._watched -= ended
        return released

    def _note_starts(self, events: list[Event]) -> None:
        """Jobs whose run starts here (a `running` status event) can be watched from now on."""
        for job_id, event_type, fields in events:
            if event_type == "status" and fields.get("status") == JobStatus.RUNNING.value:
                self._live.add(job_id)

    def _publish_events(self, events: list[Event]) -> None:
        try:
            self.publisher.publish_many(events)
        except redis.RedisError:
            log.warning("could not publish %d events", len(events), exc_info=True)

    def _publish(self, deltas: list[Delta]) -> None:
        merged = merge_deltas(self._unsent + deltas)
        if not merged:
            return
        events: list[Event] = [
            (
                delta.job_id,
                "delta",
                {
                    "attempt": delta.attempt,
                    "text": delta.text,
                    "tokens": delta.tokens,
                    "at": round(delta.at, 6),
                },
            )
            for delta in merged
        ]
        try:
            self.publisher.publish_many(events)
            self.events_published += len(merged)
            self._unsent = []
        except redis.RedisError:
            self._unsent = merged  # sent first next time, so each stream keeps its order
            log.warning("could not publish %d deltas; kept to send again", len(merged))


def merge_deltas(deltas: list[Delta]) -> list[Delta]:
    """One delta per job and attempt, in order of first appearance, texts concatenated."""
    merged: dict[tuple[str, int], Delta] = {}
    for delta in deltas:
        key = (delta.job_id, delta.attempt)
        seen = merged.get(key)
        if seen is None:
            merged[key] = Delta(delta.job_id, delta.attempt, delta.text, delta.tokens, delta.at)
        else:
            seen.text += delta.text
            seen.tokens += delta.tokens
    return [delta for delta in merged.values() if delta.text or delta.tokens]
