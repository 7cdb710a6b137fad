"""Merged and cached jobs: where a job's text came from, and its result-cache key.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add jobs.served_from and jobs.cache_key (both null for earlier jobs)."""
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("served_from", sa.String(10)))
        batch.add_column(sa.Column("cache_key", sa.String(64)))


def downgrade() -> None:
    """Drop them."""
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("cache_key")
        batch.drop_column("served_from")
