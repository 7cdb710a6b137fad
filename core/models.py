"""SQLAlchemy models: the durable record of jobs, batches, API keys and LoRA adapters."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from core.states import JobStatus


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


def as_utc(moment: datetime) -> datetime:
    """`moment` as aware UTC; SQLite hands stored datetimes back naive."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


class Utf8Text(TypeDecorator[str]):
    """Text stored as its UTF-8 bytes, so every string round-trips on every database.

    PostgreSQL's text types reject NUL characters, which prompts and model output may contain.
    """

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> bytes | None:
        """str → UTF-8 bytes."""
        return None if value is None else value.encode("utf-8", "surrogatepass")

    def process_result_value(self, value: bytes | None, dialect: Dialect) -> str | None:
        """UTF-8 bytes → str."""
        return None if value is None else bytes(value).decode("utf-8", "surrogatepass")


class Base(DeclarativeBase):
    """Declarative base whose metadata Alembic migrates."""


class Job(Base):
    """One generation request and everything that happened to it."""

    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("owner", "idempotency_key", name="uq_jobs_owner_idempotency_key"),
        Index("ix_jobs_owner_created", "owner", "created_at", "id"),
        Index("ix_jobs_status", "status"),
        Index("ix_jobs_status_queue_deadline", "status", "queue_deadline_at"),
        Index("ix_jobs_batch", "batch_id", "batch_index"),
        Index("ix_jobs_finished", "finished_at"),
        Index("ix_jobs_prompt_prefix", "prompt_prefix_id"),
        Index("ix_jobs_experiment", "experiment", "variant"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    owner: Mapped[str] = mapped_column(String(200))
    tier: Mapped[str] = mapped_column(String(20))
    status: Mapped[str] = mapped_column(String(20), default=JobStatus.QUEUED.value)

    # The prompt is `prompt_prefix_id`'s text (if any) followed by `prompt`: a batch's jobs store
    # the text their prompts share (a Q&A batch's document) once (see `core.prompts`).
    prompt: Mapped[str] = mapped_column(Utf8Text)
    prompt_prefix_id: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("prompt_prefixes.id")
    )
    # The served name of the model the job was submitted to (null for jobs from before 0007).
    model: Mapped[str | None] = mapped_column(String(200))
    sampling_params: Mapped[dict[str, Any]] = mapped_column(JSON)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    timeout_s: Mapped[float] = mapped_column(Float)

    output_text: Mapped[str | None] = mapped_column(Utf8Text)
    finish_reason: Mapped[str | None] = mapped_column(String(40))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    # Of `completion_tokens`, those a lost run streamed and the last run continued.
    resumed_tokens: Mapped[int | None] = mapped_column(Integer)
    # Where the text came from (`ServedFrom`); the cache key names a deterministic request.
    served_from: Mapped[str | None] = mapped_column(String(10))
    cache_key: Mapped[str | None] = mapped_column(String(64))

    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    first_token_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # A job still queued at this moment ends `timed_out` without running.
    queue_deadline_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    attempt: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(200))
    error_code: Mapped[str | None] = mapped_column(String(80))
    error_message: Mapped[str | None] = mapped_column(Text)

    # A job made for a batch: which one, its place in it, and (OpenAI batches) its custom_id.
    batch_id: Mapped[str | None] = mapped_column(String(40))
    batch_index: Mapped[int | None] = mapped_column(Integer)
    custom_id: Mapped[str | None] = mapped_column(String(200))
    # An A/B experiment's job (`core.experiments`): which variant it ran as, for whom, and the
    # score a client gave its answer.
    experiment: Mapped[str | None] = mapped_column(String(100))
    variant: Mapped[str | None] = mapped_column(String(100))
    end_user: Mapped[str | None] = mapped_column(String(200))
    feedback_score: Mapped[float | None] = mapped_column(Float)


class PromptPrefix(Base):
    """The text that begins the prompts of many jobs, stored once and named by its SHA-256."""

    __tablename__ = "prompt_prefixes"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    text: Mapped[str] = mapped_column(Utf8Text)
    # Its tokens as the job's count begins with them (special tokens included).
    tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class LoraAdapter(Base):
    """A LoRA adapter of the served model, selected by naming it as a job's model."""

    __tablename__ = "lora_adapters"
    # The engine's id for the adapter: a name registered again gets a new one, so a worker
    # never serves the old weights under it (SQLite would reuse the last row's id).
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    path: Mapped[str] = mapped_column(Text)
    rank: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ApiKey(Base):
    """An API key: only its SHA-256 hash is stored; the key itself is shown once."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    owner: Mapped[str] = mapped_column(String(200))
    tier: Mapped[str] = mapped_column(String(20))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Quotas; None: no limit of that kind.
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)


class Batch(Base):
    """A group of jobs made together: a document Q&A batch or an OpenAI batch.

    Q&A batches (`kind` "qa") keep the document, questions, template and sampling parameters;
    OpenAI batches (`kind` "openai") keep the input file, endpoint and window, the output and
    error files, and a timestamp per lifecycle state. Each job of a batch names it in
    `jobs.batch_id`, with its place in `jobs.batch_index`.
    """

    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_owner_created", "owner", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    kind: Mapped[str] = mapped_column(String(10))
    owner: Mapped[str] = mapped_column(String(200))
    tier: Mapped[str] = mapped_column(String(20))
    status: Mapped[str] = mapped_column(String(20))
    request_total: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)

    # Q&A batches.
    document: Mapped[str | None] = mapped_column(Utf8Text)
    questions: Mapped[list[str] | None] = mapped_column(JSON)
    prompt_template: Mapped[str | None] = mapped_column(Utf8Text)
    sampling_params: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    # OpenAI batches.
    endpoint: Mapped[str | None] = mapped_column(String(60))
    completion_window: Mapped[str | None] = mapped_column(String(10))
    input_file_id: Mapped[str | None] = mapped_column(String(40))
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class StoredFile(Base):
    """An uploaded file (OpenAI's /v1/files) or one inferq wrote (a batch's output or errors)."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_owner_created", "owner", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    owner: Mapped[str] = mapped_column(String(200))
    purpose: Mapped[str] = mapped_column(String(40))
    filename: Mapped[str] = mapped_column(String(400))
    size_bytes: Mapped[int] = mapped_column(Integer)
    content: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


SCHEMA_REVISION = "0011"
"""The Alembic head this code expects; /readyz compares it with the database."""
