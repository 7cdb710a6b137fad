"""The state changes of OpenAI batches: each a conditional UPDATE, so racing API processes agree.

in_progress → cancelling (a cancel) or expired_at set (its window passed) → finalizing (every
job final, claimed by one process) → completed | cancelled | expired, with the result files
stored in the same transaction as the end state. Batches with no valid request are stored
`failed` at once. Reading jobs per batch is `core.batches.BatchStore`'s.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import and_, or_, select, update

from core.db import Database
from core.models import Batch, StoredFile, utcnow

KIND = "openai"
"""`batches.kind` of OpenAI batches."""

OPEN_STATES = ("in_progress", "cancelling")
"""States from which a batch is finalized once all its jobs are final."""

FINALIZE_STALE_S = 120.0
"""A claim on finalizing older than this is taken over (its process died mid-way)."""


class OpenAIBatchStore:
    """Reads and conditionally updates OpenAI batch rows."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def add(self, batch: Batch, files: list[StoredFile]) -> Batch:
        """Store a batch (one that failed at creation) with its files, in one transaction."""
        with self.db.session() as session:
            session.add_all(files)
            session.add(batch)
        return batch

    def get(self, batch_id: str, owner: str) -> Batch | None:
        """The owner's OpenAI batch, or None."""
        with self.db.session() as session:
            return session.scalars(
                select(Batch).where(Batch.id == batch_id, Batch.owner == owner, Batch.kind == KIND)
            ).first()

    def list_for_owner(self, owner: str, *, limit: int, after: Batch | None) -> list[Batch]:
        """The owner's OpenAI batches, newest first, strictly past `after`."""
        query = select(Batch).where(Batch.owner == owner, Batch.kind == KIND)
        if after is not None:
            query = query.where(
                or_(
                    Batch.created_at < after.created_at,
                    and_(Batch.created_at == after.created_at, Batch.id < after.id),
                )
            )
        query = query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit)
        with self.db.session() as session:
            return list(session.scalars(query))

    def mark_cancelling(self, batch_id: str, now: datetime) -> bool:
        """in_progress → cancelling; False if the batch was not in progress."""
        return self._update(
            [Batch.status == "in_progress"],
            status="cancelling",
            batch_id=batch_id,
            cancelling_at=now,
        )

    def mark_expired(self, batch_id: str, now: datetime) -> bool:
        """Record that an in-progress batch's window passed; False if already recorded."""
        return self._update(
            [Batch.status == "in_progress", Batch.expired_at.is_(None)],
            batch_id=batch_id,
            expired_at=now,
        )

    def claim_finalizing(self, batch_id: str, now: datetime) -> bool:
        """Take the batch into finalizing (or take over a stale claim); False if another has it."""
        stale = now - timedelta(seconds=FINALIZE_STALE_S)
        return self._update(
            [
                or_(
                    Batch.status.in_(OPEN_STATES),
                    and_(Batch.status == "finalizing", Batch.finalizing_at < stale),
                )
            ],
            batch_id=batch_id,
            status="finalizing",
            finalizing_at=now,
        )

    def finish(
        self,
        batch: Batch,
        claimed_at: datetime,
        output: StoredFile | None,
        errors: StoredFile | None,
    ) -> bool:
        """Store the result files and the end state; False (nothing stored) if the claim was lost.

        The end state follows what happened: a cancel → cancelled, an expiry → expired, else
        completed.
        """
        now = utcnow()
        if batch.cancelling_at is not None:
            end = {"status": "cancelled", "cancelled_at": now}
        elif batch.expired_at is not None:
            end = {"status": "expired"}
        else:
            end = {"status": "completed", "completed_at": now}
        files = [f for f in (output, errors) if f is not None]
        with self.db.session() as session:
            session.add_all(files)
            session.flush()
            result = session.execute(
                update(Batch)
                .where(
                    Batch.id == batch.id,
                    Batch.status == "finalizing",
                    Batch.finalizing_at == claimed_at,
                )
                .values(
                    output_file_id=output.id if output else None,
                    error_file_id=errors.id if errors else None,
                    finished_at=now,
                    **end,
                )
                .execution_options(synchronize_session=False)
            )
            if not result.rowcount:  # type: ignore[attr-defined]
                session.rollback()
                return False
        return True

    def _update(self, conditions: list[object], *, batch_id: str, **values: object) -> bool:
        with self.db.session() as session:
            result = session.execute(
                update(Batch)
                .where(Batch.id == batch_id, *conditions)  # type: ignore[arg-type]
                .values(**values)
                .execution_options(synchronize_session=False)
            )
            return bool(result.rowcount)  # type: ignore[attr-defined]
