"""Reads of jobs asked for at the same moment (waits that end together) share one query."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.exc import OperationalError, ProgrammingError

from api.job_reads import MAX_READ, JobReads
from core.db import Database
from core.jobs import JobStore
from core.new_jobs import NewJob


def _jobs_selects(store: JobStore) -> list[str]:
    """Every SELECT on the jobs table from now on."""
    statements: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "jobs" in statement:
            statements.append(statement)

    event.listen(store.db.engine, "before_cursor_execute", note)
    return statements


def _stored(store: JobStore, count: int) -> list[str]:
    new = [
        NewJob(
            owner="reader",
            tier="premium",
            prompt=f"Question {i}?",
            sampling_params={"max_tokens": 8},
            timeout_s=60,
            prompt_tokens=3,
        )
        for i in range(count)
    ]
    return [job.id for job in store.create_many(new)]


def test_reads_asked_for_together_share_one_query(store: JobStore) -> None:
    ids = _stored(store, 50)
    selects = _jobs_selects(store)
    reads = JobReads(store)

    async def together() -> list[Any]:
        # 50 waits ending in one turn of the loop, one of them asking for two jobs at once.
        return await asyncio.gather(
            *(reads.get(job_id) for job_id in ids[:48]),
            reads.get_many(ids[48:]),
            reads.get("job_missing"),
        )

    found = asyncio.run(together())
    assert [job.id for job in found[:48]] == ids[:48]
    assert set(found[48]) == set(ids[48:])
    assert found[49] is None
    assert len(selects) == 1, selects


def test_a_read_asked_for_while_one_runs_joins_the_next(store: JobStore) -> None:
    ids = _stored(store, 4)
    selects = _jobs_selects(store)
    reads = JobReads(store)

    async def in_two_waves() -> list[Any]:
        first = asyncio.ensure_future(asyncio.gather(*(reads.get(i) for i in ids[:2])))
        await asyncio.sleep(0)  # the first query is under way
        second = await asyncio.gather(*(reads.get(i) for i in ids[2:]))
        return [*await first, *second]

    found = asyncio.run(in_two_waves())
    assert [job.id for job in found] == ids
    assert len(selects) == 2, selects


def test_a_burst_past_the_largest_query_takes_several(store: JobStore) -> None:
    ids = _stored(store, MAX_READ + 20)
    selects = _jobs_selects(store)
    reads = JobReads(store)

    async def together() -> list[Any]:
        return await asyncio.gather(*(reads.get(job_id) for job_id in ids))

    found = asyncio.run(together())
    assert [job.id for job in found] == ids
    assert len(selects) == 2, len(selects)


def test_a_failed_query_reaches_every_read_of_it(tmp_path: Path) -> None:
    reads = JobReads(JobStore(Database(f"sqlite:///{tmp_path / 'unmigrated.db'}")))

    async def together() -> list[Any]:
        return await asyncio.gather(
            *(reads.get(f"job_{i}") for i in range(3)), return_exceptions=True
        )

    failures = asyncio.run(together())
    assert all(isinstance(failure, OperationalError | ProgrammingError) for failure in failures)


def test_a_lone_read_returns_the_whole_job_or_none(store: JobStore) -> None:
    (job_id,) = _stored(store, 1)
    selects = _jobs_selects(store)
    reads = JobReads(store)

    job = asyncio.run(reads.get(job_id))
    missing = asyncio.run(reads.get("job_missing"))

    assert job is not None and (job.id, job.prompt, job.tier) == (job_id, "Question 0?", "premium")
    assert job.sampling_params == {"max_tokens": 8} and job.status == "queued"
    assert missing is None
    assert len(selects) == 2, selects
