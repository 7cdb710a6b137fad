"""How many of a job's tokens a lost run streamed and its last run continued.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add jobs.resumed_tokens (null: the job's text was made in one run)."""
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("resumed_tokens", sa.Integer))


def downgrade() -> None:
    """Drop it."""
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("resumed_tokens")
