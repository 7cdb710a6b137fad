"""The model a job was submitted to: its served name, as clients see it.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add jobs.model (null for earlier jobs)."""
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("model", sa.String(200)))


def downgrade() -> None:
    """Drop it."""
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("model")
