"""Retention: delete finished work once it is older than `retention_days`.

What goes, for a cutoff (now less `retention_days`):
- a job that is not part of a batch, once it is final and finished before the cutoff;
- a batch (document Q&A or OpenAI), created and finished before the cutoff, with no job that
  is unfinished or finished after it — together with all its jobs and the output and error
  files inferq wrote for it. Its jobs never go one by one, so a batch never loses answers
  while it can still be read.

- a stored prompt prefix (`core.prompts`), once no job's prompt begins with it.

Files a user uploaded (`POST /v1/files`) stay until the user deletes them, as with OpenAI.
Unfinished jobs and batches are never touched, however old. Rows go in chunks of
`retention_chunk` per transaction, so a large purge never holds a long lock on the tables the
API and workers write to, and an interrupted purge simply continues at the next run.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, exists, or_, select
from sqlalchemy.exc import IntegrityError

from core.db import Database
from core.models import Batch, Job, PromptPrefix, StoredFile, utcnow
from core.settings import Settings
from core.states import FINAL_STATES

log = logging.getLogger(__name__)

_FINAL = [state.value for state in FINAL_STATES]
_BATCHES_PER_ROUND = 100


@dataclass
class PurgeReport:
    """How many rows one purge deleted."""

    jobs: int = 0
    batches: int = 0
    files: int = 0
    prefixes: int = 0


def retention_cutoff(days: float, now: datetime | None = None) -> datetime:
    """The moment before which finished work is deleted, `days` before `now`."""
    return (now or utcnow()) - timedelta(days=days)


class Retention:
    """Deletes finished jobs and batches that finished before a cutoff, a chunk at a time."""

    def __init__(self, db: Database, chunk: int = 1000) -> None:
        self.db = db
        self.chunk = chunk

    def purge(self, cutoff: datetime) -> PurgeReport:
        """Delete everything that finished before `cutoff` (see the module's docstring)."""
        report = PurgeReport()
        self._purge_batches(cutoff, report)
        self._purge_jobs(cutoff, report)
        if report.jobs:
            self._purge_prefixes(report)
        return report

    def _purge_prefixes(self, report: PurgeReport) -> None:
        # A job stored meanwhile that begins with one of them keeps it: on PostgreSQL the
        # foreign key fails this statement (the next purge tries again); SQLite has one writer.
        unused = ~exists().where(Job.prompt_prefix_id == PromptPrefix.id)
        try:
            with self.db.session() as session:
                deleted = session.execute(delete(PromptPrefix).where(unused))
        except IntegrityError:
            log.info("retention: a prompt prefix was taken up again; its purge waits a round")
            return
        report.prefixes += deleted.rowcount  # type: ignore[attr-defined]

    def _purge_jobs(self, cutoff: datetime, report: PurgeReport) -> None:
        query = (
            select(Job.id)
            .where(
                Job.batch_id.is_(None),
                Job.status.in_(_FINAL),
                Job.finished_at < cutoff,
            )
            .limit(self.chunk)
        )
        while True:
            with self.db.session() as session:
                ids = list(session.scalars(query))
                if ids:
                    session.execute(delete(Job).where(Job.id.in_(ids)))
            report.jobs += len(ids)
            if len(ids) < self.chunk:
                return

    def _purge_batches(self, cutoff: datetime, report: PurgeReport) -> None:
        still_open = exists().where(
            Job.batch_id == Batch.id,
            or_(
                Job.status.not_in(_FINAL),
                Job.finished_at.is_(None),
                Job.finished_at >= cutoff,
            ),
        )
        query = (
            select(Batch.id, Batch.output_file_id, Batch.error_file_id)
            .where(
                Batch.created_at < cutoff,
                or_(Batch.finished_at.is_(None), Batch.finished_at < cutoff),
                ~still_open,
            )
            .limit(_BATCHES_PER_ROUND)
        )
        while True:
            with self.db.session() as session:
                batches = list(session.execute(query))
            for batch_id, output_file_id, error_file_id in batches:
                self._purge_batch(batch_id, [output_file_id, error_file_id], report)
            if len(batches) < _BATCHES_PER_ROUND:
                return

    def _purge_batch(self, batch_id: str, file_ids: list[str | None], report: PurgeReport) -> None:
        jobs = select(Job.id).where(Job.batch_id == batch_id).limit(self.chunk)
        while True:
            with self.db.session() as session:
                ids = list(session.scalars(jobs))
                if ids:
                    session.execute(delete(Job).where(Job.id.in_(ids)))
            report.jobs += len(ids)
            if len(ids) < self.chunk:
                break
        # The batch's row last: until it goes, a purge that stopped half-way finds it again.
        written = [file_id for file_id in file_ids if file_id is not None]
        with self.db.session() as session:
            if written:
                files = session.execute(delete(StoredFile).where(StoredFile.id.in_(written)))
                report.files += files.rowcount  # type: ignore[attr-defined]
            batches = session.execute(delete(Batch).where(Batch.id == batch_id))
            report.batches += batches.rowcount  # type: ignore[attr-defined]


def purge_old(settings: Settings, db: Database, days: float | None = None) -> PurgeReport:
    """Delete what finished more than `days` (default: `retention_days`) ago."""
    days = settings.retention_days if days is None else days
    cutoff = retention_cutoff(days)
    report = Retention(db, settings.retention_chunk).purge(cutoff)
    log.info(
        "retention: deleted %d jobs, %d batches, %d files and %d prompt prefixes finished "
        "before %s",
        report.jobs,
        report.batches,
        report.files,
        report.prefixes,
        cutoff.isoformat(timespec="seconds"),
    )
    return report


def run_retention(settings: Settings, db: Database, stopped: threading.Event) -> None:
    """Purge at start, then every `retention_interval_s`, until `stopped`; a failure is retried."""
    if settings.retention_days <= 0:
        log.info("retention off (retention_days 0): finished jobs are kept")
        return
    log.info(
        "retention: jobs kept %g days, purged every %gs",
        settings.retention_days,
        settings.retention_interval_s,
    )
    while not stopped.is_set():
        try:
            purge_old(settings, db)
        except Exception:
            log.exception("retention purge failed; retrying at the next interval")
        stopped.wait(settings.retention_interval_s)
