"""Group commit for job submissions: jobs posted at the same moment share one transaction."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.concurrency import run_in_threadpool

from core.jobs import JobStore
from core.metrics import count_submitted
from core.models import Job
from core.new_jobs import NewJob
from core.queue.dispatch import Dispatcher, queued

RETRY_S = 1.0
"""How often jobs stored while Redis was out are offered to it again."""


class SubmissionBatcher:
    """Stores and enqueues validated jobs in batches.

    Each request hands its job over and waits; one task takes everything waiting, stores it in
    one transaction and enqueues it over one broker connection (in the thread pool), so a burst
    of POSTs costs a few commits rather than one each. A lone request is a batch of one.

    A stored job is accepted even if Redis fails just after the commit: the dispatcher keeps
    it, and this task offers it to Redis again every `RETRY_S` until it is sent.
    """

    def __init__(self, jobs: JobStore, dispatcher: Dispatcher) -> None:
        self.jobs = jobs
        self.dispatcher = dispatcher
        self._pending: list[tuple[NewJob, asyncio.Future[Job]]] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Begin taking submissions; call from the running event loop."""
        self._task = asyncio.create_task(self._run(), name="inferq-submissions")

    async def stop(self) -> None:
        """Stop taking submissions."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def submit(self, new: NewJob) -> Job:
        """Store and enqueue `new` together with whatever else is being submitted now."""
        future: asyncio.Future[Job] = asyncio.get_running_loop().create_future()
        self._pending.append((new, future))
        self._wakeup.set()
        return await future

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=RETRY_S)
            if self.dispatcher.has_deferred():  # stored while Redis was out: send them now
                await run_in_threadpool(self.dispatcher.send_deferred)
            if not self._wakeup.is_set():
                continue
            self._wakeup.clear()
            batch, self._pending = self._pending, []
            try:
                stored = await run_in_threadpool(self._store_and_enqueue, [new for new, _ in batch])
            except Exception as exc:  # each waiting request answers with it
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), job in zip(batch, stored, strict=True):
                if not future.done():
                    future.set_result(job)

    def _store_and_enqueue(self, batch: list[NewJob]) -> list[Job]:
        # The rows are committed before any id is enqueued.
        stored = self.jobs.create_many(batch)
        headers = [new.trace_headers for new in batch]
        route_chars = self.dispatcher.settings.prefix_route_chars
        self.dispatcher.submit_or_defer(queued(stored, headers, route_chars=route_chars))
        count_submitted(job.tier for job in stored)
        return stored
