"""Reads of jobs after a wait: those asked for at the same moment share one query.

A burst of jobs usually ends together (the engine runs them as one batch), and every
submission or long poll waiting on them then reads its job again to answer. One read by key
per request, each in a thread of its own, was a quarter of the API's CPU in a run of 256 jobs
sent one POST each. Here the reads asked for in one turn of the event loop go to the
database as one `IN` query in one thread, and those asked for while it runs make the next.
"""

from __future__ import annotations

import asyncio
import itertools

from starlette.concurrency import run_in_threadpool

from core.jobs import JobStore
from core.models import Job

MAX_READ = 500
"""Most jobs one query reads (SQLite caps the parameters of a statement)."""


class JobReads:
    """Current rows of jobs by id, read together with any other read asked for meanwhile."""

    def __init__(self, jobs: JobStore) -> None:
        self.jobs = jobs
        self._pending: dict[str, list[asyncio.Future[Job | None]]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def get_many(self, job_ids: list[str]) -> dict[str, Job]:
        """The jobs among `job_ids` that exist, by id; a database error is raised here."""
        loop = asyncio.get_running_loop()
        futures = []
        for job_id in job_ids:
            future: asyncio.Future[Job | None] = loop.create_future()
            self._pending.setdefault(job_id, []).append(future)
            futures.append(future)
        if self._reader is None or self._reader.done():
            # Runs after the callbacks already due in this turn: reads they ask for join in.
            self._reader = loop.create_task(self._read_pending(), name="inferq-job-reads")
        found = await asyncio.gather(*futures, return_exceptions=True)
        jobs = {}
        for job in found:
            if isinstance(job, BaseException):
                raise job
            if job is not None:
                jobs[job.id] = job
        return jobs

    async def get(self, job_id: str) -> Job | None:
        """The job, or None if it does not exist."""
        return (await self.get_many([job_id])).get(job_id)

    async def _read_pending(self) -> None:
        while self._pending:
            batch = dict(itertools.islice(self._pending.items(), MAX_READ))
            for job_id in batch:
                del self._pending[job_id]
            try:
                found = await run_in_threadpool(self.jobs.get_many, list(batch))
            except Exception as exc:  # every read of the batch hears about it
                for futures in batch.values():
                    for future in futures:
                        if not future.done():
                            future.set_exception(exc)
                continue
            for job_id, futures in batch.items():
                for future in futures:
                    if not future.done():  # a waiter gone meanwhile has cancelled its own
                        future.set_result(found.get(job_id))
