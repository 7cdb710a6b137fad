"""Per-key quotas: requests and tokens per minute, concurrent jobs.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

COLUMNS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")


def upgrade() -> None:
    """Add the quota columns to api_keys (null: unlimited)."""
    with op.batch_alter_table("api_keys") as batch:
        for name in COLUMNS:
            batch.add_column(sa.Column(name, sa.Integer()))


def downgrade() -> None:
    """Drop them."""
    with op.batch_alter_table("api_keys") as batch:
        for name in COLUMNS:
            batch.drop_column(name)
