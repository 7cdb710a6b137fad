"""Live event streams for every reader of an API process, over one Redis connection.

An SSE or WebSocket reader follows a job's event stream (`core.events`) to its final event. A
blocking XREAD per reader would hold a Redis connection per reader (past the pool's size, a
reader waits for one) and cost a command and a round trip per event. Instead `EventRelay` keeps
one connection of its own, blocked in one XREAD over the streams of every reader of the process,
and hands each reader its events in order. A worker publishes an engine step's deltas of many
jobs in one call (`workers.streams`), so one XREAD brings them all.

A reader that joins while that XREAD blocks gets its stream into the next one at once: the
relay's connection is unblocked with `CLIENT UNBLOCK`, sent on the shared pool. Should that miss
(the relay reconnected and its client id changed), the reader waits out the XREAD's block, at
most `MAX_BLOCK_MS`.

Each reader's place is the sequence number of the last event handed to it, so a lost connection
loses and repeats nothing: the relay connects again and reads on from there. Once Redis has
failed for `patience_s`, every reader gets the error, and its client resumes with
Last-Event-ID. Replays that do not wait (a job already ended) read the stream directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from core import keys
from core.events import is_final, parse_events, stream_id

log = logging.getLogger(__name__)

REDIS_PATIENCE_S = 30.0
"""How long a stream waits out Redis errors (a dropped connection, a server starved of CPU, a
failover) before it gives up and closes; its reader then resumes with Last-Event-ID."""
MAX_BLOCK_MS = 2000
"""The longest one XREAD blocks (well inside the connection's socket timeout)."""
COUNT = 500
"""Entries one XREAD takes from each stream; a longer backlog comes in the next rounds."""
RETRY_S = (0.1, 2.0)
"""First and longest pause before reading again after a Redis error."""
_UNBLOCK_TRIES = 20
_UNBLOCK_EVERY_S = 0.005


class Follow:
    """One reader's place in a job's stream and the events waiting for it."""

    def __init__(self, job_id: str, after_seq: int) -> None:
        self.job_id = job_id
        self.after = after_seq
        self._events: list[dict[str, Any]] = []
        self._error: BaseException | None = None
        self._wakeup: asyncio.Future[None] | None = None

    async def next(self, timeout_s: float) -> list[dict[str, Any]]:
        """The events after those already taken, oldest first; [] if `timeout_s` passes first.

        Raises the Redis error that made the relay give up."""
        if not self._events and self._error is None:
            self._wakeup = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(max(timeout_s, 0.0)):
                    await self._wakeup
            except TimeoutError:
                pass
            finally:
                self._wakeup = None
        if self._events:
            events, self._events = self._events, []
            return events
        if self._error is not None:
            raise self._error
        return []

    def _hand(self, events: list[dict[str, Any]]) -> None:
        self._events.extend(events)
        self.after = events[-1]["seq"]
        self._wake()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)


class EventRelay:
    """Every live reader's events through one blocking XREAD (see the module docstring)."""

    def __init__(
        self,
        relay_client: aioredis.Redis,
        client: aioredis.Redis,
        *,
        patience_s: float,
        max_block_ms: int = MAX_BLOCK_MS,
    ) -> None:
        self._relay_client = relay_client  # its own connection: it blocks
        self._client = client  # the shared pool, for CLIENT UNBLOCK
        self._patience_s = patience_s
        self._max_block_ms = max_block_ms
        self._follows: dict[str, list[Follow]] = {}
        self._task: asyncio.Task[None] | None = None
        self._joined = asyncio.Event()
        self._client_id: int | None = None
        self._reading: dict[str, int] | None = None  # the XREAD under way: job id -> from
        self._left_out = False  # a reader joined that the XREAD under way does not serve
        self._unblocking: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def follow(self, job_id: str, after_seq: int) -> AsyncIterator[Follow]:
        """Follow the job's stream after event `after_seq` until the block ends."""
        follow = Follow(job_id, after_seq)
        self._follows.setdefault(job_id, []).append(follow)
        self._start()
        self._joined.set()
        reading = self._reading  # a blocked XREAD without this place is ended
        if reading is not None and (job_id not in reading or reading[job_id] > after_seq):
            self._left_out = True
            self._unblock()
        try:
            yield follow
        finally:
            self._leave(follow)

    def readers(self) -> int:
        """Readers following a stream now."""
        return sum(len(follows) for follows in self._follows.values())

    async def close(self) -> None:
        """Stop reading; the readers left get no more events."""
        # A cancelled XREAD can wait out its block (seen here): end the block first.
        if self._reading is not None and self._client_id is not None:
            with contextlib.suppress(redis.exceptions.RedisError, TimeoutError):
                await asyncio.wait_for(self._client.client_unblock(self._client_id), 1)
        for task in (self._task, self._unblocking):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._unblocking = None
        await self._relay_client.aclose(close_connection_pool=True)

    def _leave(self, follow: Follow) -> None:
        follows = self._follows.get(follow.job_id)
        if follows is not None and follow in follows:
            follows.remove(follow)
            if not follows:
                del self._follows[follow.job_id]

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    def _unblock(self) -> None:
        if self._unblocking is None or self._unblocking.done():
            self._unblocking = asyncio.ensure_future(self._unblock_reading())

    async def _unblock_reading(self) -> None:
        """End the blocking XREAD while a reader it does not serve waits, so that the next
        includes it.

        The XREAD may not have reached Redis yet: then nothing is unblocked, and this tries
        again. Missing every time, the relay's id is read again before its next XREAD (its
        connection may have been replaced without an error)."""
        for _ in range(_UNBLOCK_TRIES):
            client_id = self._client_id
            if not self._left_out or self._reading is None or client_id is None:
                return
            try:
                if await self._client.client_unblock(client_id):
                    return
            except redis.exceptions.RedisError:
                log.debug("event relay: CLIENT UNBLOCK failed", exc_info=True)
                return
            await asyncio.sleep(_UNBLOCK_EVERY_S)
        self._client_id = None

    async def _run(self) -> None:
        delay_s = RETRY_S[0]
        failing_since: float | None = None
        while True:
            if not self._follows:
                self._joined.clear()
                self._client_id = None  # an idle connection may be replaced silently
                await self._joined.wait()
            try:
                if self._client_id is None:
                    self._client_id = int(await self._relay_client.client_id())
                after, reply = await self._read_round()
                self._hand_out(after, reply)
            except redis.exceptions.RedisError as exc:
                self._client_id = None
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    log.warning("event relay: reading streams failed (%r); trying again", exc)
                if now - failing_since >= self._patience_s:
                    self._fail_all(exc)
                    failing_since = None
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, RETRY_S[1])
                continue
            except Exception as exc:  # not Redis's: no reader is left waiting on it
                log.exception("event relay: reading streams failed")
                self._fail_all(exc)
                await asyncio.sleep(RETRY_S[1])
                continue
            delay_s, failing_since = RETRY_S[0], None

    async def _read_round(self) -> tuple[dict[str, int], Any]:
        """One XREAD over every followed stream, from the earliest place of its readers: the
        place read from per job, and the reply."""
        after = {
            job_id: min(follow.after for follow in follows)
            for job_id, follows in self._follows.items()
        }
        self._reading, self._left_out = after, False
        try:
            reply = await self._relay_client.xread(
                {keys.job_event_stream(job_id): stream_id(seq) for job_id, seq in after.items()},
                block=self._max_block_ms,
                count=COUNT,
            )
        finally:
            self._reading = None
        return after, reply

    def _hand_out(self, after: dict[str, int], reply: Any) -> None:
        streams = {keys.job_event_stream(job_id): job_id for job_id in after}
        for stream, entries in reply or []:
            job_id = streams[stream.decode() if isinstance(stream, bytes) else str(stream)]
            events = parse_events(entries)
            for follow in list(self._follows.get(job_id, ())):
                # A reader that joined during the round from an earlier place gets these in
                # the next round, after the ones it lacks.
                if follow.after < after[job_id]:
                    continue
                mine = [event for event in events if event["seq"] > follow.after]
                if mine:
                    follow._hand(mine)
                    if is_final(mine[-1]):
                        self._leave(follow)  # its reader stops there

    def _fail_all(self, error: BaseException) -> None:
        log.warning("event relay: closing %d streams (%r)", self.readers(), error)
        for follows in list(self._follows.values()):
            for follow in list(follows):
                follow._fail(error)
                self._leave(follow)
