"""OpenAI batches without services: input lines, their jobs, result lines and batch objects."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from tokenizers import Tokenizer

from api.errors import uses_openai_errors
from api.openai.batch_protocol import (
    DuplicateCustomId,
    InvalidLine,
    RequestCounts,
    RequestLine,
    batch_object,
    invalid_line,
    jsonl,
    line_job,
    parse_input,
    result_records,
)
from core.errors import ClientError, InvalidRequest, ModelNotFound
from core.modelinfo import ModelInfo, ServedModels
from core.models import Batch, Job
from core.states import JobStatus
from workers.tiny_model import build_tokenizer_json

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def _model() -> ModelInfo:
    return ModelInfo(
        name="m", max_model_len=64, tokenizer=Tokenizer.from_str(build_tokenizer_json())
    )


def _line(custom_id: str, url: str = COMPLETIONS, **body: Any) -> str:
    body = body or {"model": "m", "prompt": "Hi"}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _file(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def test_lines_split_into_requests_and_invalid_lines_in_file_order() -> None:
    parsed = parse_input(
        _file(
            _line("a"),
            "",
            "not json",
            "[1, 2]",
            json.dumps({"method": "POST", "url": COMPLETIONS, "body": {}}),
            json.dumps({"custom_id": "get", "method": "GET", "url": COMPLETIONS, "body": {}}),
            _line("chat", CHAT),
            json.dumps({"custom_id": "nobody", "method": "POST", "url": COMPLETIONS}),
            _line("x" * 201),
            "   ",
            _line("b"),
        ),
        COMPLETIONS,
    )
    assert [(r.line, r.position, r.custom_id) for r in parsed.requests] == [
        (1, 0, "a"),
        (11, 8, "b"),
    ]
    assert [(i.line, i.position, i.custom_id, i.code) for i in parsed.invalid] == [
        (3, 1, None, "invalid_json_line"),
        (4, 2, None, "invalid_json_line"),
        (5, 3, None, "missing_custom_id"),
        (6, 4, "get", "invalid_method"),
        (7, 5, "chat", "invalid_url"),
        (8, 6, "nobody", "missing_body"),
        (9, 7, None, "invalid_custom_id"),
    ]
    assert all(i.message.startswith(f"Line {i.line}: ") for i in parsed.invalid)


def test_a_line_that_is_not_utf8_is_invalid() -> None:
    parsed = parse_input(_line("a").encode() + b"\n\xff\xfe\n", COMPLETIONS)
    assert [(i.line, i.code) for i in parsed.invalid] == [(2, "invalid_json_line")]


def test_a_custom_id_with_a_nul_is_an_invalid_line() -> None:
    # It would key a job row, and PostgreSQL text cannot hold a NUL (a 500 there before).
    parsed = parse_input(_file(_line("a"), _line("b\x00")), COMPLETIONS)
    assert [r.custom_id for r in parsed.requests] == ["a"]
    assert [(i.line, i.code, i.custom_id) for i in parsed.invalid] == [
        (2, "invalid_custom_id", None)
    ]


def test_a_duplicate_custom_id_rejects_the_whole_file() -> None:
    with pytest.raises(DuplicateCustomId) as caught:
        parse_input(_file(_line("a"), _line("b"), "oops", _line("a")), COMPLETIONS)
    assert caught.value.code == "duplicate_custom_id" and caught.value.status_code == 400
    assert "'a'" in caught.value.message and "line 4" in caught.value.message
    assert "line 1" in caught.value.message


def test_a_file_without_lines_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="no requests"):
        parse_input(b"\n  \n", COMPLETIONS)


def test_a_completion_line_becomes_the_job_the_live_endpoint_would_make() -> None:
    request = RequestLine(1, 0, "a", {"model": "m", "prompt": ["Hi"], "max_tokens": 4, "seed": 1})
    job = line_job(request, COMPLETIONS, ServedModels(_model(), {}))
    assert (job.prompt, job.max_tokens, job.seed) == ("Hi", 4, 1)


def test_a_chat_line_is_rendered_with_the_models_template() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    job = line_job(RequestLine(1, 0, "a", body), CHAT, ServedModels(_model(), {}))
    assert job.prompt == "User: Hi\nAssistant:" and job.max_tokens == 2


@pytest.mark.parametrize(
    ("body", "error", "param"),
    [
        ({"model": "m", "prompt": "Hi", "max_tokens": "4"}, InvalidRequest, "body.max_tokens"),
        ({"model": "m", "prompt": "Hi", "stream": True}, InvalidRequest, "body.stream"),
        ({"model": "other", "prompt": "Hi"}, ModelNotFound, "body.model"),
        ({"model": "m", "prompt": [1, 2]}, InvalidRequest, "body.prompt"),
        ({"model": "m", "prompt": "Hi", "n": 2}, InvalidRequest, "body.n"),
        ({"model": "m", "prompt": "Hi", "surprise": 1}, InvalidRequest, "body.surprise"),
    ],
)
def test_a_body_the_endpoint_would_refuse_is_refused_with_its_param(
    body: dict[str, Any], error: type[ClientError], param: str
) -> None:
    request = RequestLine(3, 2, "c", body)
    with pytest.raises(error) as caught:
        line_job(request, COMPLETIONS, ServedModels(_model(), {}))
    assert caught.value.param == param
    invalid = invalid_line(request, caught.value)
    assert (invalid.line, invalid.custom_id, invalid.param) == (3, "c", param)
    assert invalid.message.startswith("Line 3: ")


def _job(index: int, status: JobStatus, custom_id: str, **fields: Any) -> Job:
    return Job(
        id=f"job_{index:032x}",
        status=status.value,
        custom_id=custom_id,
        batch_index=index,
        created_at=datetime(2025, 1, 1, tzinfo=UTC),
        prompt_tokens=3,
        **fields,
    )


def test_results_interleave_back_into_input_order() -> None:
    jobs = [
        _job(0, JobStatus.SUCCEEDED, "a", output_text="hello", completion_tokens=2),
        _job(1, JobStatus.CANCELLED, "b"),
        _job(2, JobStatus.TIMED_OUT, "c", error_code="queue_timeout", error_message="late"),
        _job(3, JobStatus.SUCCEEDED, "d", output_text="bye", finish_reason="length"),
    ]
    invalid = [
        InvalidLine(2, 1, None, "invalid_json_line", "Line 2: not valid JSON.").record(),
        InvalidLine(6, 4, "x", "model_not_found", "Line 6: no", "body.model").record(),
    ]
    output, errors = result_records("batch_ab", jobs, invalid, "m", COMPLETIONS)
    assert [r["custom_id"] for r in output] == ["a", "d"]
    assert output[0]["response"]["status_code"] == 200
    assert output[0]["response"]["request_id"] == jobs[0].id
    body = output[0]["response"]["body"]
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "hello"
    assert output[1]["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert [(r["custom_id"], r["error"]["code"]) for r in errors] == [
        (None, "invalid_json_line"),
        ("b", "job_cancelled"),
        ("c", "queue_timeout"),
        ("x", "model_not_found"),
    ]
    assert errors[0]["response"] is None and errors[0]["error"]["line"] == 2
    assert errors[1]["response"]["status_code"] == 409
    assert errors[2]["response"]["status_code"] == 504
    assert errors[2]["error"]["message"] == "late"
    assert errors[3]["error"]["line"] == 6 and errors[3]["error"]["param"] == "body.model"
    assert len({r["id"] for r in output + errors}) == 6
    # Writing them again writes the same lines.
    assert result_records("batch_ab", jobs, invalid, "m", COMPLETIONS) == (output, errors)


def test_jsonl_is_one_record_per_line() -> None:
    data = jsonl([{"a": "ü"}, {"b": None}])
    assert data.decode().splitlines() == ['{"a":"ü"}', '{"b":null}']


def test_request_counts_count_invalid_lines_and_unsuccessful_jobs_as_failed() -> None:
    jobs = {
        JobStatus.SUCCEEDED: 4,
        JobStatus.FAILED: 1,
        JobStatus.CANCELLED: 2,
        JobStatus.TIMED_OUT: 1,
        JobStatus.RUNNING: 3,
    }
    assert RequestCounts.of(14, 3, jobs) == RequestCounts(14, 4, 7)


def test_the_batch_object_has_openais_shape() -> None:
    created = datetime(2025, 1, 1, tzinfo=UTC)
    batch = Batch(
        id="batch_1",
        status="in_progress",
        endpoint=CHAT,
        completion_window="24h",
        input_file_id="file-1",
        created_at=created,
        in_progress_at=created,
        expires_at=created + timedelta(hours=24),
        metadata_={"k": "v"},
        errors=[InvalidLine(2, 1, "z", "invalid_url", "Line 2: wrong").record()],
    )
    shown = batch_object(batch, RequestCounts(3, 1, 1))
    assert shown["object"] == "batch" and shown["status"] == "in_progress"
    assert shown["created_at"] == int(created.timestamp())
    assert shown["expires_at"] == shown["created_at"] + 24 * 3600
    assert shown["completed_at"] is None and shown["output_file_id"] is None
    assert shown["request_counts"] == {"total": 3, "completed": 1, "failed": 1}
    assert shown["errors"] == {
        "object": "list",
        "data": [{"code": "invalid_url", "message": "Line 2: wrong", "param": None, "line": 2}],
    }
    assert shown["metadata"] == {"k": "v"}


def test_files_and_batches_answer_errors_in_openais_shape() -> None:
    for path in ("/v1/files", "/v1/files/file-1/content", "/v1/batches", "/v1/batches/b/cancel"):
        assert uses_openai_errors(path)
    assert not uses_openai_errors("/v1/qa-batches")
