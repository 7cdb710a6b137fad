"""Batches and files: document Q&A batches, OpenAI batches and their files; jobs' batch fields.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def _when(name: str) -> sa.Column[sa.DateTime]:
    return sa.Column(name, sa.DateTime(timezone=True))


def upgrade() -> None:
    """Create `batches` and `files`; add jobs.batch_id, batch_index and custom_id."""
    op.create_table(
        "batches",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("kind", sa.String(10), nullable=False),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("tier", sa.String(20), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("request_total", sa.Integer, nullable=False),
        _when("created_at"),
        _when("finished_at"),
        sa.Column("metadata", sa.JSON),
        sa.Column("errors", sa.JSON),
        sa.Column("document", sa.LargeBinary),
        sa.Column("questions", sa.JSON),
        sa.Column("prompt_template", sa.LargeBinary),
        sa.Column("sampling_params", sa.JSON),
        sa.Column("endpoint", sa.String(60)),
        sa.Column("completion_window", sa.String(10)),
        sa.Column("input_file_id", sa.String(40)),
        sa.Column("output_file_id", sa.String(40)),
        sa.Column("error_file_id", sa.String(40)),
        *(
            _when(f"{state}_at")
            for state in (
                "in_progress",
                "finalizing",
                "completed",
                "failed",
                "expired",
                "expires",
                "cancelling",
                "cancelled",
            )
        ),
    )
    op.create_index("ix_batches_owner_created", "batches", ["owner", "created_at", "id"])
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("purpose", sa.String(40), nullable=False),
        sa.Column("filename", sa.String(400), nullable=False),
        sa.Column("size_bytes", sa.Integer, nullable=False),
        sa.Column("content", sa.LargeBinary, nullable=False),
        _when("created_at"),
    )
    op.create_index("ix_files_owner_created", "files", ["owner", "created_at", "id"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("batch_id", sa.String(40)))
        batch.add_column(sa.Column("batch_index", sa.Integer))
        batch.add_column(sa.Column("custom_id", sa.String(200)))
        batch.create_index("ix_jobs_batch", ["batch_id", "batch_index"])


def downgrade() -> None:
    """Drop them."""
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_batch")
        batch.drop_column("custom_id")
        batch.drop_column("batch_index")
        batch.drop_column("batch_id")
    op.drop_index("ix_files_owner_created", "files")
    op.drop_table("files")
    op.drop_index("ix_batches_owner_created", "batches")
    op.drop_table("batches")
