"""What the worker asks of an engine and what it gets back; no engine imports here."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from core.adapters import Adapter
from core.states import JobStatus


@dataclass(frozen=True)
class GenerationRequest:
    """One attempt of a job as the engine sees it."""

    request_id: str
    prompt: str
    sampling: dict[str, Any]
    priority: int
    timeout_s: float
    job_id: str = ""
    attempt: int = 0
    adapter: Adapter | None = None
    """The LoRA adapter to run with; None: the base model."""
    shared_prefix: str = ""
    """The beginning of `prompt` that other jobs' prompts share (a Q&A batch's document), cut at
    a token's start: the engine may tokenize it once for all of them (`workers.prompt_ids`)."""
    prompt_tokens: int | None = None
    """The API's count of `prompt`'s tokens, where it has one."""


@dataclass
class Delta:
    """Text one attempt of a job made in one engine step."""

    job_id: str
    attempt: int
    text: str
    tokens: int
    at: float = 0.0
    """When the engine's output for the step arrived (Unix time); the stream-latency clock."""


DeltaSink = Callable[[list[Delta]], None]
"""Receives each engine step's deltas, in order; called on the engine's thread, must not block."""


@dataclass
class GenerationResult:
    """How a generation ended, with whatever text was made before it ended."""

    status: JobStatus
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_prompt_tokens: int | None = None
    first_token_at: datetime | None = None
    error_code: str | None = None
    error_message: str | None = None
    merged: bool = False
    """Whether the text came from an identical job's engine request (see `workers.merging`)."""
    resumed_tokens: int | None = None
    """Tokens of the text that a lost run streamed and this one continued (`workers.resume`)."""
    chunks: list[str] = field(default_factory=list, repr=False)


class Engine(Protocol):
    """The worker's view of an inference engine: submit, cancel, shut down."""

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        """Start generating; the future resolves when the request ends, however it ends."""
        ...

    def cancel(self, request_id: str) -> bool:
        """Abort a running request; its result is `cancelled` with the partial text."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and free its devices."""
        ...
