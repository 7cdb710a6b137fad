"""Request and response bodies of the job endpoints."""

from __future__ import annotations

import base64
import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.errors import InvalidRequest
from core.models import Job, as_utc

NO_NUL = r"^[^\x00]*$"
"""Pattern of a string that names a stored resource: PostgreSQL cannot compare text with a NUL."""

StopText = Annotated[str, Field(min_length=1)]
"""A stop sequence: the engine refuses an empty one, so the API does first."""


class Message(BaseModel):
    """One turn of a conversation, as the model's chat template takes it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str


class JobCreate(BaseModel):
    """A generation job as a client submits it; unknown fields and wrong types are rejected.

    The job's prompt is `prompt` as it is (a plain completion), or `messages` rendered with the
    model's chat template, as an instruct model expects; exactly one of the two.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        pattern=NO_NUL,
        description="A served model (default: the first, INFERQ_MODEL) or a registered LoRA "
        "adapter of the first; GET /v1/models lists them.",
    )
    experiment: str | None = Field(
        default=None,
        min_length=1,
        max_length=100,
        pattern=NO_NUL,
        description="An A/B experiment to run the job in: one of its variants, chosen by "
        "`user`, sets the job's model and sampling (over what the request says).",
    )
    user: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        pattern=NO_NUL,
        description="Who the job is for; an experiment gives one user one variant (default: "
        "the key's owner).",
    )
    prompt: str | None = Field(default=None, min_length=1, description="The text to continue.")
    messages: list[Message] | None = Field(
        default=None,
        min_length=1,
        description="Instead of `prompt`: a conversation, rendered with the model's chat "
        "template (with the assistant's turn opened for the answer).",
    )
    max_tokens: int | None = Field(
        default=None, gt=0, description="Tokens to generate; default and cap come from the tier."
    )
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: StopText | list[StopText] | None = Field(default=None, description="Stop sequence(s).")
    seed: int | None = Field(default=None, description="Fixed seed for reproducible sampling.")
    ignore_eos: bool = Field(
        default=False, description="Keep generating past end-of-sequence (benchmarks)."
    )
    timeout_s: float | None = Field(
        default=None, gt=0, description="Total time limit; at most the tier's."
    )
    cache: bool = Field(
        default=True,
        description="A deterministic job (temperature 0 or a seed) may be answered from, and "
        "stored in, the result cache; false: neither.",
    )

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> JobCreate:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self

    def message_dicts(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them (empty for a plain prompt)."""
        return [message.model_dump() for message in self.messages or []]

    def text_length(self) -> int:
        """Characters of prompt or messages: what tokenizing the job will cost."""
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(message.content) for message in self.messages or [])

    def sampling_params(self, max_tokens: int) -> dict[str, Any]:
        """The parameters handed to the engine, without unset ones."""
        params: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": self.stop,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos or None,
        }
        return {k: v for k, v in params.items() if v is not None}


MAX_BATCH_JOBS = 5000
"""The most jobs one `POST /v1/jobs/batch` takes (as many as a Q&A batch's questions)."""


class JobBatchCreate(BaseModel):
    """Many jobs in one request: all are accepted, or none."""

    model_config = ConfigDict(extra="forbid", strict=True)

    jobs: list[JobCreate] = Field(min_length=1, max_length=MAX_BATCH_JOBS)


class Usage(BaseModel):
    """Token counts of a job."""

    prompt_tokens: int | None
    completion_tokens: int | None
    cached_prompt_tokens: int | None
    resumed_tokens: int | None = Field(
        default=None,
        description="Of completion_tokens, those a lost run had streamed and the last run "
        "continued, rather than made again; null: the text was made in one run.",
    )


class Timings(BaseModel):
    """Seconds spent queued, until the first token, and in all (from submission)."""

    queue_s: float | None
    ttft_s: float | None
    total_s: float | None


class JobErrorOut(BaseModel):
    """Why a job did not succeed."""

    code: str
    message: str


class JobOut(BaseModel):
    """A job as clients see it."""

    id: str
    object: Literal["job"] = "job"
    status: str
    tier: str
    model: str | None = Field(
        description="What the job runs on: a served model's name, or a LoRA adapter's."
    )
    created_at: datetime
    text: str | None
    finish_reason: str | None
    usage: Usage
    timings: Timings
    sampling_params: dict[str, Any]
    attempt: int
    served_from: str | None = Field(
        description="engine, merged (shared an identical job's engine run) or cache; "
        "null until the job has ended."
    )
    error: JobErrorOut | None
    experiment: str | None = None
    variant: str | None = Field(default=None, description="The experiment's variant it ran as.")
    feedback_score: float | None = None

    @classmethod
    def from_job(cls, job: Job) -> JobOut:
        """The response body for a stored job."""
        created = as_utc(job.created_at)

        def since_created(moment: datetime | None) -> float | None:
            return None if moment is None else round((as_utc(moment) - created).total_seconds(), 6)

        return cls(
            id=job.id,
            status=job.status,
            tier=job.tier,
            model=job.model,
            created_at=created,
            text=job.output_text,
            finish_reason=job.finish_reason,
            usage=Usage(
                prompt_tokens=job.prompt_tokens,
                completion_tokens=job.completion_tokens,
                cached_prompt_tokens=job.cached_prompt_tokens,
                resumed_tokens=job.resumed_tokens,
            ),
            timings=Timings(
                queue_s=since_created(job.started_at),
                ttft_s=since_created(job.first_token_at),
                total_s=since_created(job.finished_at),
            ),
            sampling_params=job.sampling_params,
            attempt=job.attempt,
            served_from=job.served_from,
            experiment=job.experiment,
            variant=job.variant,
            feedback_score=job.feedback_score,
            error=JobErrorOut(code=job.error_code, message=job.error_message or "")
            if job.error_code
            else None,
        )


class FeedbackCreate(BaseModel):
    """A client's score for a job's answer, for its experiment's report."""

    model_config = ConfigDict(extra="forbid", strict=True)

    score: float = Field(ge=-1e6, le=1e6, description="Any scale the experiment's owner reads.")


class JobList(BaseModel):
    """One page of a caller's jobs, newest first."""

    object: Literal["list"] = "list"
    data: list[JobOut]
    next_cursor: str | None


def encode_cursor(job: Job) -> str:
    """An opaque cursor pointing just past `job` in newest-first order."""
    raw = json.dumps([as_utc(job.created_at).isoformat(), job.id])
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """The (created_at, id) a cursor points past; InvalidRequest if it was not made here."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        created_at, job_id = json.loads(base64.urlsafe_b64decode(padded))
        return datetime.fromisoformat(created_at), str(job_id)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest("The cursor is not valid.", param="cursor") from exc
