"""Waiting for jobs to end: one subscription per API process, not one blocking read per wait.

Long polls (`GET /v1/jobs/{id}?wait=N`), submissions under `Prefer: wait` and cancellations
wait for jobs' final events. A blocking read per job would hold a Redis connection per wait:
a thousand long polls, a thousand connections (and past the pool's size, a wait for one). So
the job ids of final events are also published on one channel (`keys.FINAL_EVENTS_CHANNEL`,
one message naming every job that one publishing call ended, space-separated), and
`FinalEvents` keeps one subscription to it for the whole process; a wait is a future that the
job's id resolves.

A wait may begin after its job has ended, so it first checks whether the job's event stream
ends with a final event (`core.events.ended_jobs`); the checks of the waits that begin together
are one pipelined round trip. A final event published while the subscription is down (Redis
restarting) is not lost either: every time Redis confirms the subscription (at first, and after
each reconnection, whether redis-py reconnected on its own or this module subscribed again),
every wait registered by then is checked the same way, and again every `SWEEP_S` while any wait
is pending.

A caller that reads the jobs' state itself can spare the first check: `watch` registers the
waits *before* the read, and a job the read finds unended publishes its final event after it
(every writer of a final state stores it first, then publishes). So if Redis had confirmed the
subscription before the registration and has not confirmed another since, the event comes on
that subscription or, were it lost meanwhile, the check at the next confirmation finds it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager

import redis.asyncio as aioredis

from core import keys
from core.events import ended_jobs

log = logging.getLogger(__name__)

SWEEP_S = 5.0
"""How often the pending waits' jobs are checked for a final event the channel did not bring."""
RETRY_S = (0.2, 5.0)
"""First and longest pause before subscribing again after losing Redis."""


class FinalEvents:
    """The process's waits for final events (see the module docstring)."""

    def __init__(self, client: aioredis.Redis, sweep_s: float = SWEEP_S) -> None:
        self._redis = client
        self._sweep_s = sweep_s
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._listener: asyncio.Task[None] | None = None
        self._round: tuple[set[str], asyncio.Future[None]] | None = None
        """The job ids the next check will read, and the future it resolves."""
        self._checking: asyncio.Task[None] | None = None
        self._confirmed: int | None = None
        """The number of Redis's last confirmation of the subscription (None: lost since)."""
        self._confirmations = 0

    async def wait(self, job_ids: Collection[str], timeout_s: float) -> bool:
        """Wait until every one of the jobs has published its final event; False if `timeout_s`
        passes first. Raises a Redis error if Redis cannot be asked whether they have ended."""
        # The jobs' state was read before this registration: their streams are checked.
        with self._registered(job_ids, confirmed=None) as watch:
            return await watch.wait(timeout_s)

    @contextmanager
    def watch(self, job_ids: Collection[str]) -> Iterator[Watch]:
        """Register waits for the jobs' final events; read their state inside the block, then
        `wait` on those still unended (see the module docstring)."""
        with self._registered(job_ids, self._confirmed) as watch:
            yield watch

    @contextmanager
    def _registered(self, job_ids: Collection[str], confirmed: int | None) -> Iterator[Watch]:
        if job_ids:
            self._listen()
        loop = asyncio.get_running_loop()
        futures = {job_id: loop.create_future() for job_id in job_ids}
        for job_id, future in futures.items():
            self._waiters.setdefault(job_id, []).append(future)
        try:
            yield Watch(self, futures, confirmed)
        finally:
            for job_id, future in futures.items():
                self._forget(job_id, future)

    @property
    def listening(self) -> bool:
        """Whether Redis has confirmed the subscription and it still stands."""
        return self._confirmed is not None

    def pending(self) -> int:
        """Waits under way (one per job and wait)."""
        return sum(len(futures) for futures in self._waiters.values())

    async def close(self) -> None:
        """Stop listening; pending waits run out their timeouts."""
        for task in (self._listener, self._checking):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._listener = self._checking = None

    def _forget(self, job_id: str, future: asyncio.Future[None]) -> None:
        futures = self._waiters.get(job_id)
        if futures is None:
            return
        futures.remove(future)
        if not futures:
            del self._waiters[job_id]

    async def _check_unless_confirmed(
        self, futures: dict[str, asyncio.Future[None]], confirmed: int | None
    ) -> None:
        """Check the jobs' streams unless Redis has confirmed no subscription since `confirmed`
        (see the module docstring)."""
        if confirmed is None or confirmed != self._confirmed:
            await self._check(futures)

    def _ended(self, job_id: str) -> None:
        for future in self._waiters.get(job_id, ()):
            if not future.done():
                future.set_result(None)

    async def _check(self, job_ids: Collection[str]) -> None:
        """Resolve the waits of those jobs that have ended.

        A check that is under way was sent before these ids were known: they go in the next
        one, which every caller arriving meanwhile shares.
        """
        if self._round is None:
            self._round = (set(), asyncio.get_running_loop().create_future())
        ids, done = self._round
        ids.update(job_ids)
        if self._checking is None or self._checking.done():
            self._checking = asyncio.ensure_future(self._run_checks())
        # A caller that goes away (its client hung up) does not cancel the others' check.
        await asyncio.shield(done)

    async def _run_checks(self) -> None:
        while self._round is not None:
            (ids, done), self._round = self._round, None
            job_ids = [job_id for job_id in ids if job_id in self._waiters]
            try:
                ended = await ended_jobs(self._redis, job_ids)
            except Exception as exc:  # every caller of this round hears it
                done.set_exception(exc)
                done.exception()  # seen, even when every caller went away before it ended
                continue
            for job_id in ended:
                self._ended(job_id)
            done.set_result(None)

    def _listen(self) -> None:
        if self._listener is None or self._listener.done():
            self._listener = asyncio.ensure_future(self._subscribed())

    async def _subscribed(self) -> None:
        """Resolve waits from the channel until cancelled, subscribing again after errors."""
        delay_s = RETRY_S[0]
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(keys.FINAL_EVENTS_CHANNEL)
                swept_at = math.inf  # until Redis confirms the subscription
                while True:
                    if time.monotonic() - swept_at >= self._sweep_s:
                        swept_at = time.monotonic()
                        if self._waiters:
                            await self._check(list(self._waiters))
                    message = await pubsub.get_message(timeout=self._sweep_s)
                    if message is not None and message["type"] == "subscribe":
                        delay_s = RETRY_S[0]
                        self._confirmations += 1
                        self._confirmed = self._confirmations
                        swept_at = -math.inf  # what ended unheard is found by a sweep now
                    elif message is not None and message["type"] == "message":
                        data = message["data"]  # the ids of the jobs one call ended
                        text = data.decode() if isinstance(data, bytes) else str(data)
                        for job_id in text.split():
                            self._ended(job_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis gone or restarting: the waits keep their timeouts
                self._confirmed = None
                log.warning("final events: subscription lost (%r); again in %.1f s", exc, delay_s)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, RETRY_S[1])
            finally:
                self._confirmed = None
                await asyncio.shield(_close(pubsub))


class Watch:
    """Waits registered for some jobs' final events (`FinalEvents.watch`)."""

    def __init__(
        self,
        events: FinalEvents,
        futures: dict[str, asyncio.Future[None]],
        confirmed: int | None,
    ) -> None:
        self._events = events
        self._futures = futures
        self._confirmed = confirmed
        """The subscription Redis had confirmed when these waits were registered."""

    async def wait(self, timeout_s: float) -> bool:
        """Wait until every one of the jobs has published its final event; False if `timeout_s`
        passes first. Raises a Redis error if Redis cannot be asked whether they have ended."""
        if not self._futures:
            return True
        await self._events._check_unless_confirmed(self._futures, self._confirmed)
        pending = [future for future in self._futures.values() if not future.done()]
        if pending and timeout_s > 0:
            _, left = await asyncio.wait(pending, timeout=timeout_s)
            return not left
        return not pending


async def _close(pubsub: aioredis.client.PubSub) -> None:
    try:
        await pubsub.aclose()
    except Exception:  # its connection is already gone
        log.debug("final events: closing the subscription failed", exc_info=True)
