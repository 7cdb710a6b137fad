"""Jobs and API keys.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the jobs and api_keys tables."""
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("tier", sa.String(20), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        # Text as UTF-8 bytes (core.models.Utf8Text): PostgreSQL text cannot hold NUL.
        sa.Column("prompt", sa.LargeBinary(), nullable=False),
        sa.Column("sampling_params", sa.JSON(), nullable=False),
        sa.Column("idempotency_key", sa.String(200)),
        sa.Column("request_hash", sa.String(64)),
        sa.Column("timeout_s", sa.Float(), nullable=False),
        sa.Column("output_text", sa.LargeBinary()),
        sa.Column("finish_reason", sa.String(40)),
        sa.Column("prompt_tokens", sa.Integer()),
        sa.Column("completion_tokens", sa.Integer()),
        sa.Column("cached_prompt_tokens", sa.Integer()),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True)),
        sa.Column("first_token_at", sa.DateTime(timezone=True)),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(200)),
        sa.Column("error_code", sa.String(80)),
        sa.Column("error_message", sa.Text()),
        sa.UniqueConstraint("owner", "idempotency_key", name="uq_jobs_owner_idempotency_key"),
    )
    op.create_index("ix_jobs_owner_created", "jobs", ["owner", "created_at", "id"])
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("tier", sa.String(20), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True)),
    )


def downgrade() -> None:
    """Drop both tables."""
    op.drop_table("api_keys")
    op.drop_index("ix_jobs_status", "jobs")
    op.drop_index("ix_jobs_owner_created", "jobs")
    op.drop_table("jobs")
