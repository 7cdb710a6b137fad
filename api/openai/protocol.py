"""The OpenAI-compatible protocol: request bodies, their jobs, and the response and chunk shapes.

Requests become ordinary jobs (`JobCreate`, validated as `POST /v1/jobs` validates them); jobs'
outcomes and stream events become OpenAI completions, chunks and error objects. The routes are
in `api.openai.router`.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from api.errors import describe_validation_error
from api.schemas import NO_NUL, JobCreate, StopText
from core.errors import InvalidRequest, ModelNotFound
from core.models import Job, as_utc
from core.states import JobStatus

CompletionKind = Literal["text_completion", "chat.completion"]

SSE_DONE = "data: [DONE]\n\n"


class StreamOptions(BaseModel):
    """What a stream carries besides the text."""

    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = Field(
        default=None, description="Send a last chunk with the token counts (and no choices)."
    )


# Fields clients send that inferq does not implement: accepted at their neutral values only,
# so a request never silently means something else than its sender asked.
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "response_format": ({"type": "text"},),
}


class _GenerationRequest(BaseModel):
    """The fields the completions and chat completions requests share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(
        pattern=NO_NUL,
        description="The served model's id, or a registered LoRA adapter's (see GET /v1/models).",
    )
    max_tokens: int | None = Field(default=None, description="Default and cap from the tier.")
    temperature: float | None = None
    top_p: float | None = None
    stop: StopText | list[StopText] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, description="Choices to make; only 1 is supported.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(
        default=None, description="inferq and vLLM extension: keep going past end-of-sequence."
    )
    user: str | None = Field(default=None, description="Accepted and ignored.")
    frequency_penalty: JsonValue = None
    presence_penalty: JsonValue = None
    logit_bias: JsonValue = None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """400 for what inferq cannot do: n > 1, and non-neutral values of unsupported fields."""
        if self.n is not None and self.n != 1:
            raise InvalidRequest("Only n=1 is supported.", param="n")
        for name, neutral in _NEUTRAL_VALUES.items():
            value = getattr(self, name, None)
            if value is not None and not any(_same(value, ok) for ok in neutral):
                raise InvalidRequest(f"{name} is not supported by this server.", param=name)

    def job_body(self, prompt: str, max_tokens: int | None) -> JobCreate:
        """The job for `prompt`, validated as `POST /v1/jobs` validates a body."""
        fields = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": self.stop,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
        }
        try:
            return JobCreate.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            param, message = describe_validation_error(dict(exc.errors()[0]))
            raise InvalidRequest(message, param=param) from exc


def _same(value: Any, neutral: Any) -> bool:
    # `False == 0` in Python; a neutral value must also have the sent value's JSON type.
    return type(value) is type(neutral) and value == neutral


class CompletionRequest(_GenerationRequest):
    """`POST /v1/completions`: continue one prompt."""

    prompt: JsonValue = Field(description="A string, or a list holding one string.")
    logprobs: JsonValue = None
    echo: JsonValue = None
    best_of: JsonValue = None
    suffix: JsonValue = None

    def prompt_text(self) -> str:
        """The one prompt string; 400 for token ids and for several prompts."""
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise InvalidRequest(
                "prompt must be a string or a list of one string (token-id prompts and several "
                "prompts in one request are not supported).",
                param="prompt",
            )
        return prompt

    def to_job(self) -> JobCreate:
        """The job this request asks for."""
        self.check_supported()
        return self.job_body(self.prompt_text(), self.max_tokens)


class ChatMessage(BaseModel):
    """One message of a conversation: text only."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, JsonValue]] | None = None
    name: str | None = Field(default=None, description="Accepted and ignored.")

    def text(self, index: int) -> str:
        """The content as one string (text parts joined); 400 for any other kind of part."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(
                    "Only text content parts ({'type': 'text', 'text': ...}) are supported.",
                    param=f"messages[{index}].content",
                )
            texts.append(str(part["text"]))
        return "".join(texts)


class ChatCompletionRequest(_GenerationRequest):
    """`POST /v1/chat/completions`: the assistant's next message in a conversation."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, description="Overrides max_tokens.")
    logprobs: JsonValue = None
    top_logprobs: JsonValue = None
    tools: JsonValue = None
    tool_choice: JsonValue = None
    response_format: JsonValue = None
    parallel_tool_calls: bool | None = Field(default=None, description="Accepted and ignored.")
    metadata: JsonValue = Field(default=None, description="Accepted and ignored.")
    store: bool | None = Field(default=None, description="Accepted and ignored.")

    def message_dicts(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them: role and text content."""
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]

    def to_job(self, prompt: str) -> JobCreate:
        """The job for this request, given its messages rendered as `prompt`."""
        self.check_supported()
        return self.job_body(prompt, self.max_completion_tokens or self.max_tokens)


def check_model(served: str, requested: str, adapters: Collection[str] = ()) -> None:
    """404 `model_not_found` unless `requested` is the served model or one of `adapters`."""
    if requested != served and requested not in adapters:
        raise ModelNotFound(
            f"The model '{requested}' does not exist; this server serves '{served}'"
            + (" and the adapters that GET /v1/models lists." if adapters else "."),
            param="model",
        )


def model_card(
    name: str,
    created: int,
    max_model_len: int,
    parent: str | None = None,
    workers: list[str] | None = None,
) -> dict[str, Any]:
    """A model as `GET /v1/models` lists it; an adapter names the model it adapts (`parent`,
    as vLLM's server lists its LoRA modules). `workers`: the live workers serving it (an
    inferq field that OpenAI's clients ignore)."""
    card: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "inferq",
        "max_model_len": max_model_len,
        "workers": workers or [],
    }
    if parent is not None:
        card["parent"] = parent
    return card


def usage(prompt_tokens: int | None, completion_tokens: int | None) -> dict[str, int]:
    """OpenAI's usage object."""
    prompt, completion = prompt_tokens or 0, completion_tokens or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def finish_reason(reason: str | None) -> str:
    """A succeeded job's finish reason in OpenAI's words: `length`, else `stop`."""
    return "length" if reason == "length" else "stop"


def created_at(job: Job) -> int:
    """The job's creation time, in Unix seconds."""
    return int(as_utc(job.created_at).timestamp())


def completion_body(job: Job, model: str, kind: CompletionKind) -> dict[str, Any]:
    """A succeeded job as a completion (or chat completion); its id is the job's."""
    text = job.output_text or ""
    choice: dict[str, Any] = {"index": 0}
    if kind == "chat.completion":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice |= {"logprobs": None, "finish_reason": finish_reason(job.finish_reason)}
    return {
        "id": job.id,
        "object": kind,
        "created": created_at(job),
        "model": model,
        "choices": [choice],
        "usage": usage(job.prompt_tokens, job.completion_tokens),
        "system_fingerprint": None,
    }


@dataclass(frozen=True)
class JobFailure:
    """How a job that did not succeed is told to an OpenAI client."""

    status_code: int
    body: dict[str, Any]
    retry: bool


def job_failure(
    job_id: str, status: JobStatus, error_code: str | None, message: str | None
) -> JobFailure:
    """The HTTP status and error object for a job that ended failed, timed out or cancelled.

    Failed is 500 and timed out 504 (clients may retry both); cancelled is 409 with
    `x-should-retry: false`, so the SDK does not undo the cancel by retrying.
    """
    if status is JobStatus.CANCELLED:
        code, http, error_type, retry = "job_cancelled", 409, "invalid_request_error", False
        message = message or f"Job '{job_id}' was cancelled before it finished."
    elif status is JobStatus.TIMED_OUT:
        code, http, error_type, retry = error_code or "timed_out", 504, "timeout_error", True
        message = message or f"Job '{job_id}' ran out of time ({code})."
    else:
        code, http, error_type, retry = error_code or "job_failed", 500, "server_error", True
        message = message or f"Job '{job_id}' failed ({code})."
    error = {"message": message, "type": error_type, "param": None, "code": code}
    return JobFailure(http, {"error": error}, retry)


def sse_data(payload: dict[str, Any]) -> str:
    """One SSE frame carrying `payload` as JSON, the way OpenAI streams frame chunks."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class ChunkFormat:
    """Builds one streamed completion's chunks: same id, creation time and model in each."""

    kind: CompletionKind
    completion_id: str
    created: int
    model: str
    include_usage: bool

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion.chunk" if self.kind == "chat.completion" else self.kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, text: str | None, reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.kind == "chat.completion":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}

    def opening(self) -> str | None:
        """The first chunk of a chat stream (the assistant's role); None for completions."""
        if self.kind != "chat.completion":
            return None
        return sse_data(self._chunk([self._choice("", None, role=True)]))

    def text(self, text: str) -> str:
        """A chunk carrying new text."""
        return sse_data(self._chunk([self._choice(text, None)]))

    def finish(self, reason: str | None) -> str:
        """The chunk that ends the choice, with its finish reason."""
        return sse_data(self._chunk([self._choice(None, finish_reason(reason))]))

    def usage(self, prompt_tokens: int | None, completion_tokens: int | None) -> str:
        """The usage chunk: no choices, the token counts."""
        chunk = self._chunk([])
        chunk["usage"] = usage(prompt_tokens, completion_tokens)
        return sse_data(chunk)
