"""Token streams: the engine's per-step deltas, published to Redis off the engine's loop.

The engine hands over every delta made in one step as one list (`publish_step`); a publisher
thread writes them in one pipelined round trip. When Redis is slower than the engine, steps
that queued up meanwhile are merged: a job's consecutive deltas become one event, so the cost
of streaming stays bounded by Redis round trips, never by tokens.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

import redis

from core.events import Event, EventPublisher
from workers.generation import Delta

log = logging.getLogger(__name__)


class DeltaPublisher:
    """Publishes deltas in the order they were made, one pipeline per batch of steps."""

    def __init__(self, publisher: EventPublisher) -> None:
        self.publisher = publisher
        self._queue: queue.SimpleQueue[list[Delta] | list[Event] | Future[None]] = (
            queue.SimpleQueue()
        )
        self.events_published = 0
        threading.Thread(target=self._loop, name="inferq-deltas", daemon=True).start()

    def publish_step(self, deltas: list[Delta]) -> None:
        """Queue one step's deltas; never blocks (the engine's loop calls this)."""
        if deltas:
            self._queue.put(deltas)

    def publish_events(self, events: list[Event]) -> None:
        """Queue other events (job id, type, fields), in order with the deltas around them."""
        if events:
            self._queue.put(events)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every delta queued before this call has been published (or dropped)."""
        barrier: Future[None] = Future()
        self._queue.put(barrier)
        barrier.result(timeout=timeout_s)

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
                if isinstance(item, Future):
                    self._publish(pending)
                    pending = []
                    item.set_result(None)
                elif item and isinstance(item[0], Delta):
                    pending.extend(item)
                else:
                    self._publish(pending)  # what came before goes out first
                    pending = []
                    self._publish_events(item)  # type: ignore[arg-type]
            self._publish(pending)

    def _publish_events(self, events: list[Event]) -> None:
        try:
            self.publisher.publish_many(events)
        except redis.RedisError:
            log.warning("could not publish %d events", len(events), exc_info=True)

    def _publish(self, deltas: list[Delta]) -> None:
        merged = merge_deltas(deltas)
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
        except redis.RedisError:
            # The stored result stays whole; a reader of this stream misses these deltas.
            log.warning("could not publish %d deltas", len(merged), exc_info=True)


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
