"""Queue deadlines: when a queued job stops waiting.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add jobs.queue_deadline_at and its index.

    Jobs queued before this revision have none; the worker still ends them at their total
    deadline when it picks them up.
    """
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("queue_deadline_at", sa.DateTime(timezone=True)))
    op.create_index("ix_jobs_status_queue_deadline", "jobs", ["status", "queue_deadline_at"])


def downgrade() -> None:
    """Drop the column and its index."""
    op.drop_index("ix_jobs_status_queue_deadline", "jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("queue_deadline_at")
