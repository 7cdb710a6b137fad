"""OpenAI's Batch API without services: the create body, input lines, result lines, objects.

An input file is JSON Lines, one request per line: `{custom_id, method: "POST", url, body}`.
`parse_input` splits it into requests and invalid lines (a duplicate custom_id rejects the
whole file); `line_job` turns a request's body into a job exactly as the live endpoint would.
The result records and the batch object follow OpenAI's shapes. The lifecycle is in
`api.openai.batches`.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.errors import describe_validation_error
from api.openai.chat_prompt import render_chat
from api.openai.protocol import (
    ChatCompletionRequest,
    CompletionKind,
    CompletionRequest,
    check_model,
    completion_body,
    job_failure,
)
from api.schemas import NO_NUL, JobCreate
from core.errors import ClientError, InvalidRequest
from core.modelinfo import ServedModels
from core.models import Batch, Job, as_utc
from core.states import JobStatus

BatchEndpoint = Literal["/v1/completions", "/v1/chat/completions"]

ENDPOINT_KINDS: dict[str, CompletionKind] = {
    "/v1/completions": "text_completion",
    "/v1/chat/completions": "chat.completion",
}
"""What each batchable endpoint answers with."""

MAX_REQUESTS = 50_000
"""Most request lines in one input file (OpenAI's limit)."""

MAX_CUSTOM_ID_CHARS = 200
"""The longest custom_id kept (the width of `jobs.custom_id`)."""


class DuplicateCustomId(InvalidRequest):
    """Two lines of one input file share a custom_id: the whole batch is rejected."""

    code = "duplicate_custom_id"


class BatchCreate(BaseModel):
    """`POST /v1/batches`: run every request of an uploaded file."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str = Field(
        max_length=40, pattern=NO_NUL, description="A file uploaded with purpose batch."
    )
    endpoint: BatchEndpoint
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


@dataclass(frozen=True)
class RequestLine:
    """A well-formed line: its place in the file and the request body it carries."""

    line: int
    """1-based line number in the file."""
    position: int
    """0-based place among the file's non-blank lines."""
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class InvalidLine:
    """A line that cannot become a job, and why; it goes to the batch's error file."""

    line: int
    position: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None

    def record(self) -> dict[str, Any]:
        """The line as stored with the batch (`batches.errors`)."""
        return asdict(self)


@dataclass(frozen=True)
class ParsedInput:
    """An input file split into requests and invalid lines, both in file order."""

    requests: list[RequestLine]
    invalid: list[InvalidLine]


def parse_input(content: bytes, endpoint: str) -> ParsedInput:
    """Split a JSON Lines input file; blank lines are skipped.

    A line that is not a JSON object, lacks a field, or names another url or method is invalid,
    not fatal. A repeated custom_id is `DuplicateCustomId`; a file with no lines, or with more
    than `MAX_REQUESTS`, is `InvalidRequest`.
    """
    requests: list[RequestLine] = []
    invalid: list[InvalidLine] = []
    first_seen: dict[str, int] = {}
    position = 0
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if position >= MAX_REQUESTS:
            raise InvalidRequest(
                f"The input file has more than {MAX_REQUESTS} requests.", param="input_file_id"
            )
        parsed = _parse_line(raw, number, position, endpoint)
        custom_id = parsed.custom_id
        if custom_id is not None:
            if custom_id in first_seen:
                raise DuplicateCustomId(
                    f"Duplicate custom_id '{custom_id}' on line {number} (first used on line "
                    f"{first_seen[custom_id]}); every custom_id in a batch must be unique.",
                    param="input_file_id",
                )
            first_seen[custom_id] = number
        if isinstance(parsed, RequestLine):
            requests.append(parsed)
        else:
            invalid.append(parsed)
        position += 1
    if position == 0:
        raise InvalidRequest("The input file has no requests.", param="input_file_id")
    return ParsedInput(requests, invalid)


def _parse_line(raw: bytes, number: int, position: int, endpoint: str) -> RequestLine | InvalidLine:
    def bad(code: str, message: str, custom_id: str | None = None) -> InvalidLine:
        return InvalidLine(number, position, custom_id, code, f"Line {number}: {message}")

    try:
        entry = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return bad("invalid_json_line", "not valid UTF-8.")
    except json.JSONDecodeError as exc:
        return bad("invalid_json_line", f"not valid JSON ({exc.msg}).")
    if not isinstance(entry, dict):
        return bad("invalid_json_line", "not a JSON object.")
    custom_id = entry.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return bad("missing_custom_id", "custom_id must be a non-empty string.")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return bad("invalid_custom_id", f"custom_id is over {MAX_CUSTOM_ID_CHARS} characters.")
    if "\x00" in custom_id:  # it keys the results, and PostgreSQL text cannot hold a NUL
        return bad("invalid_custom_id", "custom_id contains a NUL character.")
    if entry.get("method") != "POST":
        return bad("invalid_method", "method must be 'POST'.", custom_id)
    if entry.get("url") != endpoint:
        return bad(
            "invalid_url",
            f"url {json.dumps(entry.get('url'))} is not the batch's endpoint '{endpoint}'.",
            custom_id,
        )
    body = entry.get("body")
    if not isinstance(body, dict):
        return bad("missing_body", "body must be a JSON object.", custom_id)
    return RequestLine(number, position, custom_id, body)


def line_job(
    request: RequestLine, endpoint: str, models: ServedModels, adapters: Collection[str] = ()
) -> JobCreate:
    """The job a request line asks for, validated as the live endpoint validates its body
    (its model one of `models` or one of `adapters`).

    Raises the endpoint's `ClientError`, with `param` under `body.`.
    """
    try:
        if endpoint == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate(request.body)
            _check_batchable(chat.stream, chat.model, models, adapters)
            return chat.to_job(render_chat(models.of(chat.model), chat.message_dicts()))
        completion = CompletionRequest.model_validate(request.body)
        _check_batchable(completion.stream, completion.model, models, adapters)
        return completion.to_job()
    except ValidationError as exc:
        param, message = describe_validation_error(dict(exc.errors()[0]))
        raise InvalidRequest(message, param=f"body.{param}") from exc
    except ClientError as exc:
        exc.param = f"body.{exc.param}" if exc.param else "body"
        raise


def _check_batchable(
    stream: bool | None, requested: str, models: ServedModels, adapters: Collection[str]
) -> None:
    if stream:
        raise InvalidRequest("stream is not supported in a batch.", param="stream")
    check_model(models.first.name, requested, [*models.others, *adapters])


def invalid_line(request: RequestLine, error: ClientError) -> InvalidLine:
    """A request line whose body failed validation, as an invalid line."""
    return InvalidLine(
        request.line,
        request.position,
        request.custom_id,
        error.code,
        f"Line {request.line}: {error.message}",
        error.param,
    )


def request_id(job_id: str) -> str:
    """The id of a result line: stable, so writing the results twice writes the same lines."""
    return f"batch_req_{job_id.removeprefix('job_')}"


def output_record(job: Job, model: str, kind: CompletionKind) -> dict[str, Any]:
    """A succeeded request's line in the output file: the live endpoint's response body."""
    return {
        "id": request_id(job.id),
        "custom_id": job.custom_id,
        "response": {
            "status_code": 200,
            "request_id": job.id,
            "body": completion_body(job, model, kind),
        },
        "error": None,
    }


def job_error_record(job: Job) -> dict[str, Any]:
    """A request that failed, timed out or was cancelled, as a line of the error file."""
    failure = job_failure(job.id, JobStatus(job.status), job.error_code, job.error_message)
    error = failure.body["error"]
    return {
        "id": request_id(job.id),
        "custom_id": job.custom_id,
        "response": {
            "status_code": failure.status_code,
            "request_id": job.id,
            "body": failure.body,
        },
        "error": {"code": error["code"], "message": error["message"]},
    }


def line_error_record(batch_id: str, invalid: dict[str, Any]) -> dict[str, Any]:
    """An invalid input line (as stored in `batches.errors`) as a line of the error file."""
    return {
        "id": f"batch_req_{batch_id.removeprefix('batch_')}_line{invalid['line']}",
        "custom_id": invalid.get("custom_id"),
        "response": None,
        "error": {
            "code": invalid["code"],
            "message": invalid["message"],
            "param": invalid.get("param"),
            "line": invalid["line"],
        },
    }


def result_records(
    batch_id: str, jobs: list[Job], invalid: list[dict[str, Any]], model: str, endpoint: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The output file's lines and the error file's lines, each in input order.

    `jobs` are in batch order and `invalid` carries each invalid line's position among the
    file's lines, so the two interleave back into the file's order.
    """
    kind = ENDPOINT_KINDS[endpoint]
    invalid_at = {int(entry["position"]): entry for entry in invalid}
    pending = iter(jobs)
    output: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for position in range(len(jobs) + len(invalid)):
        if position in invalid_at:
            errors.append(line_error_record(batch_id, invalid_at[position]))
            continue
        job = next(pending)
        if job.status == JobStatus.SUCCEEDED.value:
            output.append(output_record(job, job.model or model, kind))
        else:
            errors.append(job_error_record(job))
    return output, errors


def jsonl(records: list[dict[str, Any]]) -> bytes:
    """Records as JSON Lines, one per line, each ending in a newline."""
    return "".join(
        json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n" for record in records
    ).encode("utf-8")


@dataclass(frozen=True)
class RequestCounts:
    """OpenAI's request_counts: failed counts invalid lines and every request not succeeded."""

    total: int
    completed: int
    failed: int

    @classmethod
    def of(cls, total: int, invalid: int, jobs: dict[JobStatus, int]) -> RequestCounts:
        """The counts from the number of invalid lines and the jobs per state."""
        not_succeeded = sum(
            jobs.get(status, 0)
            for status in (JobStatus.FAILED, JobStatus.TIMED_OUT, JobStatus.CANCELLED)
        )
        return cls(total, jobs.get(JobStatus.SUCCEEDED, 0), invalid + not_succeeded)


def unix(moment: datetime | None) -> int | None:
    """A stored moment in Unix seconds (None stays None)."""
    return None if moment is None else int(as_utc(moment).timestamp())


def batch_object(batch: Batch, counts: RequestCounts) -> dict[str, Any]:
    """A batch as OpenAI's API shows it."""
    errors = [
        {key: entry.get(key) for key in ("code", "message", "param", "line")}
        for entry in batch.errors or []
    ]
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": unix(batch.created_at),
        "in_progress_at": unix(batch.in_progress_at),
        "expires_at": unix(batch.expires_at),
        "finalizing_at": unix(batch.finalizing_at),
        "completed_at": unix(batch.completed_at),
        "failed_at": unix(batch.failed_at),
        "expired_at": unix(batch.expired_at),
        "cancelling_at": unix(batch.cancelling_at),
        "cancelled_at": unix(batch.cancelled_at),
        "request_counts": asdict(counts),
        "metadata": batch.metadata_,
    }
