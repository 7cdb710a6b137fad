"""A/B experiments: each job's experiment, variant, end user and feedback score.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the four columns (null for jobs outside experiments), and an index to report by."""
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("experiment", sa.String(100)))
        batch.add_column(sa.Column("variant", sa.String(100)))
        batch.add_column(sa.Column("end_user", sa.String(200)))
        batch.add_column(sa.Column("feedback_score", sa.Float))
        batch.create_index("ix_jobs_experiment", ["experiment", "variant"])


def downgrade() -> None:
    """Drop them."""
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_experiment")
        for column in ("feedback_score", "end_user", "variant", "experiment"):
            batch.drop_column(column)
