"""Reading and cancelling the jobs of a batch, a batch at a time."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import func, select, update

from core.db import Database
from core.models import Batch, Job, utcnow
from core.states import JobStatus


def new_batch_id(prefix: str) -> str:
    """A fresh, unguessable batch id, e.g. `qab_…`."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Cancelled:
    """What cancelling a batch did: queued jobs it ended, running ones it must abort."""

    ended: list[tuple[str, str, str]]  # (job id, tier, owner), cancelled without running
    running: list[str]  # job ids whose workers must abort them

    def ended_by_queue(self) -> dict[tuple[str, str], list[str]]:
        """The ended jobs' ids per (tier, owner): the held list each may still wait in."""
        grouped: dict[tuple[str, str], list[str]] = {}
        for job_id, tier, owner in self.ended:
            grouped.setdefault((tier, owner), []).append(job_id)
        return grouped


class BatchStore:
    """Batch rows and their jobs; every read is scoped to the batch's owner."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def get(self, batch_id: str, owner: str, kind: str) -> Batch | None:
        """The batch, or None if it does not exist, is another kind or another owner's."""
        with self.db.session() as session:
            batch = session.get(Batch, batch_id)
        if batch is None or batch.owner != owner or batch.kind != kind:
            return None
        return batch

    def counts(self, batch_id: str) -> dict[JobStatus, int]:
        """How many of the batch's jobs are in each state (every state present)."""
        query = (
            select(Job.status, func.count()).where(Job.batch_id == batch_id).group_by(Job.status)
        )
        with self.db.session() as session:
            found = {JobStatus(status): int(n) for status, n in session.execute(query)}
        return {status: found.get(status, 0) for status in JobStatus}

    def jobs(self, batch_id: str) -> list[Job]:
        """The batch's jobs in batch order."""
        query = select(Job).where(Job.batch_id == batch_id).order_by(Job.batch_index)
        with self.db.session() as session:
            return list(session.scalars(query))

    def set_status(self, batch_id: str, status: str) -> None:
        """Record the batch's own state (e.g. that a cancel was asked for)."""
        with self.db.session() as session:
            session.execute(update(Batch).where(Batch.id == batch_id).values(status=status))

    def cancel_jobs(self, batch_id: str) -> Cancelled:
        """End the batch's queued jobs as cancelled; list its running ones.

        One conditional UPDATE: a job a worker starts meanwhile is not touched here, and shows
        up as running (the caller asks its worker to abort it).
        """
        now = utcnow()
        with self.db.session() as session:
            ended = session.execute(
                update(Job)
                .where(Job.batch_id == batch_id, Job.status == JobStatus.QUEUED.value)
                .values(
                    status=JobStatus.CANCELLED.value, finished_at=now, finish_reason="cancelled"
                )
                .returning(Job.id, Job.tier, Job.owner)
                .execution_options(synchronize_session=False)
            ).all()
            running = session.scalars(
                select(Job.id).where(
                    Job.batch_id == batch_id, Job.status == JobStatus.RUNNING.value
                )
            ).all()
        return Cancelled([(job_id, tier, owner) for job_id, tier, owner in ended], list(running))
