"""An index on jobs.finished_at, for the retention purge.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Index jobs by when they finished, so old ones are found without a table scan."""
    op.create_index("ix_jobs_finished", "jobs", ["finished_at"])


def downgrade() -> None:
    """Drop it."""
    op.drop_index("ix_jobs_finished", table_name="jobs")
