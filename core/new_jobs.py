"""A job the API has validated, and the row it is stored as."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from core.models import Job
from core.prompts import SharedPrefix
from core.resultcache import CachedResult
from core.states import JobStatus, ServedFrom


def new_job_id() -> str:
    """A fresh, unguessable job id."""
    return f"job_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class NewJob:
    """What the API has validated and wants stored."""

    owner: str
    tier: str
    prompt: str
    """The prompt, or with `prompt_prefix` what follows it."""
    sampling_params: dict[str, Any]
    timeout_s: float
    prompt_tokens: int
    model: str | None = None
    queue_timeout_s: float | None = None
    idempotency_key: str | None = None
    request_hash: str | None = None
    cache_key: str | None = None
    # A repeat answered from the result cache is stored already finished.
    cached: CachedResult | None = None
    # A job made for a batch (see `core.models.Batch`).
    batch_id: str | None = None
    batch_index: int | None = None
    custom_id: str | None = None
    # The stored beginning of the prompt, shared with other jobs of its batch.
    prompt_prefix: SharedPrefix | None = None
    # An experiment's job: the variant it runs as, and the user it was chosen for.
    experiment: str | None = None
    variant: str | None = None
    end_user: str | None = None
    id: str = field(default_factory=new_job_id)
    # The submitting request's trace context, for the message (not stored).
    trace_headers: dict[str, str] = field(default_factory=dict, compare=False)

    def values(self, created_at: datetime) -> dict[str, Any]:
        """The job's row, column by column: queued, or succeeded if the cache answered it."""
        cached = self.cached
        return {
            "id": self.id,
            "owner": self.owner,
            "tier": self.tier,
            "status": (JobStatus.SUCCEEDED if cached else JobStatus.QUEUED).value,
            "prompt": self.prompt,
            "prompt_prefix_id": self.prompt_prefix.id if self.prompt_prefix else None,
            "model": self.model,
            "sampling_params": self.sampling_params,
            "idempotency_key": self.idempotency_key,
            "request_hash": self.request_hash,
            "timeout_s": self.timeout_s,
            "prompt_tokens": self.prompt_tokens,
            "created_at": created_at,
            "queue_deadline_at": created_at
            + timedelta(seconds=min(self.queue_timeout_s or self.timeout_s, self.timeout_s)),
            "attempt": 0,
            "cache_key": self.cache_key,
            "batch_id": self.batch_id,
            "batch_index": self.batch_index,
            "custom_id": self.custom_id,
            "experiment": self.experiment,
            "variant": self.variant,
            "end_user": self.end_user,
            "served_from": ServedFrom.CACHE.value if cached else None,
            "output_text": cached.text if cached else None,
            "finish_reason": cached.finish_reason if cached else None,
            "completion_tokens": cached.completion_tokens if cached else None,
            "started_at": created_at if cached else None,
            "first_token_at": created_at if cached else None,
            "finished_at": created_at if cached else None,
        }

    def row(self, created_at: datetime) -> Job:
        """The job's database row as a model object."""
        return Job(**self.values(created_at))

    def prompt_start(self, chars: int) -> str:
        """The first `chars` characters of the whole prompt."""
        if self.prompt_prefix is None:
            return self.prompt[:chars]
        head = self.prompt_prefix.text[:chars]
        return head if len(head) == chars else head + self.prompt[: chars - len(head)]
