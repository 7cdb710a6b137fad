"""LoRA adapters: registered by name and path, selected by a job's model.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add lora_adapters."""
    op.create_table(
        "lora_adapters",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("rank", sa.Integer),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sqlite_autoincrement=True,  # ids are never reused: an engine knows an adapter by its id
    )


def downgrade() -> None:
    """Drop it."""
    op.drop_table("lora_adapters")
