"""Prompt prefixes: the text a batch's prompts share (a Q&A batch's document), stored once.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add prompt_prefixes and jobs.prompt_prefix_id (null: `jobs.prompt` is the whole prompt)."""
    op.create_table(
        "prompt_prefixes",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("text", sa.LargeBinary, nullable=False),
        sa.Column("tokens", sa.Integer, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("prompt_prefix_id", sa.String(64)))
        batch.create_foreign_key(
            "fk_jobs_prompt_prefix", "prompt_prefixes", ["prompt_prefix_id"], ["id"]
        )
        batch.create_index("ix_jobs_prompt_prefix", ["prompt_prefix_id"])


def downgrade() -> None:
    """Put each job's prefix back in front of its prompt, then drop them."""
    joined = "(SELECT text FROM prompt_prefixes WHERE prompt_prefixes.id = jobs.prompt_prefix_id)"
    joined = f"{joined} || prompt"
    if op.get_bind().dialect.name == "sqlite":  # || makes text there; the column holds bytes
        joined = f"CAST({joined} AS BLOB)"
    op.execute(f"UPDATE jobs SET prompt = {joined} WHERE prompt_prefix_id IS NOT NULL")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_prompt_prefix")
        batch.drop_constraint("fk_jobs_prompt_prefix", type_="foreignkey")
        batch.drop_column("prompt_prefix_id")
    op.drop_table("prompt_prefixes")
