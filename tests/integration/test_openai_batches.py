"""OpenAI's Files and Batch APIs, driven by the official openai SDK against the running stack."""

from __future__ import annotations

import json
import time
import uuid
from datetime import timedelta
from typing import Any, Final

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types import Batch
from sqlalchemy import update

from core.files import FileStore, new_stored_file
from core.models import Batch as BatchRow
from core.models import utcnow
from core.openai_batches import FINALIZE_STALE_S, OpenAIBatchStore
from core.tiers import Tier
from tests.support import BLOCKER_TOKENS, Stack, wait_final

FINAL = ("completed", "failed", "expired", "cancelled")
COMPLETIONS: Final = "/v1/completions"


def _openai(stack: Stack, key: str) -> OpenAI:
    return OpenAI(base_url=f"{stack.api_url}/v1", api_key=key, max_retries=0, timeout=120)


def _line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def _upload(client: OpenAI, lines: list[Any]) -> str:
    return client.files.create(file=("requests.jsonl", _jsonl(lines)), purpose="batch").id


def _wait(client: OpenAI, batch_id: str, until: tuple[str, ...] = FINAL) -> Batch:
    deadline = time.monotonic() + 120
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.3)


def _results(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_chat_batch_runs_every_line_and_writes_one_result_per_custom_id(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    client = _openai(stack, key)
    model = stack.model_name
    custom_ids = ["q-1", "q-2", "q-3"]
    lines = [
        _line(
            custom_id,
            "/v1/chat/completions",
            {
                "model": model,
                "messages": [{"role": "user", "content": f"Question {custom_id}"}],
                "max_tokens": 8,
                "ignore_eos": True,
            },
        )
        for custom_id in custom_ids
    ]
    upload = client.files.create(file=("requests.jsonl", _jsonl(lines)), purpose="batch")
    assert upload.id.startswith("file-") and upload.purpose == "batch"
    assert upload.bytes == len(_jsonl(lines)) and upload.filename == "requests.jsonl"

    created = client.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert created.status in ("in_progress", "finalizing", "completed")
    assert created.request_counts is not None and created.request_counts.total == 3
    assert created.expires_at == created.created_at + 24 * 3600

    done = _wait(client, created.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 0)
    assert done.error_file_id is None and done.errors is None
    assert done.metadata == {"job": "nightly"}
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.created_at <= done.finalizing_at <= done.completed_at

    results = _results(client, done.output_file_id)
    assert [r["custom_id"] for r in results] == custom_ids
    with stack.client(key) as http:
        for result in results:
            assert result["error"] is None and result["response"]["status_code"] == 200
            body = result["response"]["body"]
            assert body["object"] == "chat.completion" and body["model"] == model
            text = body["choices"][0]["message"]["content"]
            assert text and body["usage"]["completion_tokens"] == 8
            job = wait_final(http, result["response"]["request_id"])
            assert job["text"] == text and job["tier"] == "standard"

    assert [b.id for b in client.batches.list()] == [created.id]
    files = {f.id: f.purpose for f in client.files.list()}
    assert files == {upload.id: "batch", done.output_file_id: "batch_output"}
    assert client.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)
    # The batch outlives its input file.
    assert client.batches.retrieve(created.id).status == "completed"


def test_bad_lines_go_to_the_error_file_while_the_good_ones_run(stack: Stack) -> None:
    client = _openai(stack, stack.create_key(Tier.BASIC))
    model = stack.model_name
    ok = {"model": model, "prompt": "Fine", "max_tokens": 4}
    lines = [
        _line("ok-1", COMPLETIONS, ok),
        "this is not json",
        {"method": "POST", "url": COMPLETIONS, "body": ok},
        _line("wrong-url", "/v1/chat/completions", ok),
        "",
        _line("bad-type", COMPLETIONS, {**ok, "max_tokens": "four"}),
        _line("bad-model", COMPLETIONS, {**ok, "model": "gpt-4o"}),
        _line("ok-2", COMPLETIONS, ok),
    ]
    batch = client.batches.create(
        input_file_id=_upload(client, lines), endpoint=COMPLETIONS, completion_window="24h"
    )
    done = _wait(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert done.request_counts.model_dump() == {"total": 7, "completed": 2, "failed": 5}
    assert done.errors is not None
    assert [e.line for e in done.errors.data or []] == [2, 3, 4, 6, 7]

    output = _results(client, done.output_file_id)
    assert [r["custom_id"] for r in output] == ["ok-1", "ok-2"]
    assert all(r["response"]["body"]["object"] == "text_completion" for r in output)
    errors = _results(client, done.error_file_id)
    assert [(r["custom_id"], r["error"]["line"], r["error"]["code"]) for r in errors] == [
        (None, 2, "invalid_json_line"),
        (None, 3, "missing_custom_id"),
        ("wrong-url", 4, "invalid_url"),
        ("bad-type", 6, "invalid_request"),
        ("bad-model", 7, "model_not_found"),
    ]
    assert all(r["response"] is None and "Line" in r["error"]["message"] for r in errors)
    assert errors[3]["error"]["param"] == "body.max_tokens"

    # A file with no valid line at all: the batch fails, its errors list every line.
    failed = client.batches.create(
        input_file_id=_upload(client, lines[1:4]), endpoint=COMPLETIONS, completion_window="24h"
    )
    assert failed.status == "failed" and failed.failed_at is not None
    assert failed.errors is not None and [e.line for e in failed.errors.data or []] == [1, 2, 3]
    assert failed.request_counts is not None and failed.request_counts.failed == 3
    assert len(_results(client, failed.error_file_id)) == 3


def _running_long(http: httpx.Client) -> list[dict[str, Any]]:
    jobs = http.get("/v1/jobs", params={"status": "running"}).json()["data"]
    return [j for j in jobs if j["sampling_params"]["max_tokens"] == BLOCKER_TOKENS]


def test_cancelling_a_batch_stops_its_running_requests(stack: Stack) -> None:
    key = stack.create_key(Tier.PREMIUM)
    client = _openai(stack, key)
    model = stack.model_name
    long_body = {
        "model": model,
        "prompt": "Go on",
        "max_tokens": BLOCKER_TOKENS,
        "ignore_eos": True,
    }
    lines = [
        _line("short", COMPLETIONS, {"model": model, "prompt": "Quick", "max_tokens": 4}),
        *[_line(f"long-{i}", COMPLETIONS, long_body) for i in range(3)],
    ]
    batch = client.batches.create(
        input_file_id=_upload(client, lines), endpoint=COMPLETIONS, completion_window="24h"
    )
    with stack.client(key) as http:
        deadline = time.monotonic() + 60
        while len(_running_long(http)) < 3:
            assert time.monotonic() < deadline, "the long requests did not start"
            time.sleep(0.2)
    running = client.batches.retrieve(batch.id)
    assert running.status == "in_progress"
    assert running.request_counts is not None and running.request_counts.total == 4

    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    assert cancelling.cancelling_at is not None
    done = _wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    counts = done.request_counts
    assert counts is not None and counts.total == 4
    assert counts.completed + counts.failed == 4 and counts.failed >= 3
    output, errors = _results(client, done.output_file_id), _results(client, done.error_file_id)
    assert len(output) == counts.completed and len(errors) == counts.failed
    cancelled = [r for r in errors if r["custom_id"].startswith("long-")]
    assert len(cancelled) == 3
    assert all(r["error"]["code"] == "job_cancelled" for r in cancelled)
    assert all(r["response"]["status_code"] == 409 for r in cancelled)
    # Cancelling again changes nothing.
    assert client.batches.cancel(batch.id).status == "cancelled"


def test_a_duplicate_custom_id_rejects_the_batch(stack: Stack) -> None:
    client = _openai(stack, stack.create_key(Tier.BASIC))
    body = {"model": stack.model_name, "prompt": "x", "max_tokens": 4}
    lines = [
        _line("a", COMPLETIONS, body),
        _line("b", COMPLETIONS, body),
        _line("a", COMPLETIONS, body),
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(
            input_file_id=_upload(client, lines), endpoint=COMPLETIONS, completion_window="24h"
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "duplicate_custom_id"
    assert "'a'" in error["message"] and "line 3" in error["message"]
    assert list(client.batches.list()) == []
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")


def test_other_owners_files_and_batches_are_not_found(stack: Stack) -> None:
    owner = _openai(stack, stack.create_key(Tier.BASIC))
    other = _openai(stack, stack.create_key(Tier.BASIC))
    body = {"model": stack.model_name, "prompt": "Mine", "max_tokens": 4}
    file_id = _upload(owner, [_line("a", COMPLETIONS, body)])
    batch = owner.batches.create(
        input_file_id=file_id, endpoint=COMPLETIONS, completion_window="24h"
    )

    for call in (
        lambda: other.files.retrieve(file_id),
        lambda: other.files.content(file_id),
        lambda: other.files.delete(file_id),
        lambda: other.batches.create(
            input_file_id=file_id, endpoint=COMPLETIONS, completion_window="24h"
        ),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(other.files.list()) == [] and list(other.batches.list()) == []
    assert _wait(owner, batch.id).status == "completed"


def test_a_batch_past_its_window_cancels_what_is_left_and_ends_expired(stack: Stack) -> None:
    key = stack.create_key(Tier.PREMIUM)
    client = _openai(stack, key)
    model = stack.model_name
    long_body = {"model": model, "prompt": "Late", "max_tokens": BLOCKER_TOKENS, "ignore_eos": True}
    batch = client.batches.create(
        input_file_id=_upload(client, [_line("slow", COMPLETIONS, long_body)]),
        endpoint=COMPLETIONS,
        completion_window="24h",
    )
    with stack.client(key) as http:
        deadline = time.monotonic() + 60
        while not _running_long(http):
            assert time.monotonic() < deadline, "the request did not start"
            time.sleep(0.2)
    # Its 24 hours pass.
    with stack.db.session() as session:
        session.execute(
            update(BatchRow)
            .where(BatchRow.id == batch.id)
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )
    done = _wait(client, batch.id)
    assert done.status == "expired" and done.expired_at is not None
    assert done.request_counts is not None
    assert done.request_counts.model_dump() == {"total": 1, "completed": 0, "failed": 1}
    [error] = _results(client, done.error_file_id)
    assert error["custom_id"] == "slow" and error["error"]["code"] == "job_cancelled"


def test_only_one_process_finalizes_a_batch(stack: Stack) -> None:
    store = OpenAIBatchStore(stack.db)
    now = utcnow()
    row = BatchRow(
        id=f"batch_{uuid.uuid4().hex}",
        kind="openai",
        owner="finalize-race",
        tier="basic",
        status="in_progress",
        request_total=0,
        created_at=now,
    )
    store.add(row, [])
    first, second = now, now + timedelta(milliseconds=5)
    assert store.claim_finalizing(row.id, first)
    assert not store.claim_finalizing(row.id, second)
    out = new_stored_file("finalize-race", "batch_output", "out.jsonl", b"{}\n")
    assert not store.finish(row, second, out, None)  # not its claim: nothing is stored
    assert FileStore(stack.db).get(out.id, "finalize-race") is None
    assert store.finish(row, first, out, None)
    finished = store.get(row.id, "finalize-race")
    assert finished is not None and finished.status == "completed"
    assert finished.output_file_id == out.id
    assert not store.claim_finalizing(row.id, now + timedelta(hours=1))  # completed stays so
    # A claim left by a process that died is taken over once it is stale.
    stale = BatchRow(
        **{**_columns(row), "id": f"batch_{uuid.uuid4().hex}", "status": "in_progress"}
    )
    store.add(stale, [])
    long_ago = now - timedelta(seconds=FINALIZE_STALE_S + 1)
    assert store.claim_finalizing(stale.id, long_ago)
    assert store.claim_finalizing(stale.id, now)
    assert not store.finish(stale, long_ago, None, None)
    assert store.finish(stale, now, None, None)


def _columns(row: BatchRow) -> dict[str, Any]:
    return {c: getattr(row, c) for c in ("kind", "owner", "tier", "request_total", "created_at")}


def test_bad_uploads_and_batches_get_clear_errors_and_enqueue_nothing(stack: Stack) -> None:
    key = stack.create_key(Tier.BASIC)
    client = _openai(stack, key)
    good = _upload(client, [_line("a", COMPLETIONS, {"model": stack.model_name, "prompt": "x"})])
    with pytest.raises(openai.BadRequestError) as wrong_purpose:
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
    assert wrong_purpose.value.code == "invalid_request" and "purpose" in str(wrong_purpose.value)
    with pytest.raises(openai.APIStatusError) as too_big:
        client.files.create(file=("big.jsonl", b"x" * (2 << 20)), purpose="batch")
    assert too_big.value.status_code == 413
    with pytest.raises(openai.BadRequestError) as wrong_endpoint:
        client.batches.create(
            input_file_id=good,
            endpoint="/v1/embeddings",  # type: ignore[arg-type]
            completion_window="24h",
        )
    assert wrong_endpoint.value.status_code == 400
    # A file that is not JSON Lines at all: every line is refused, the batch fails at once.
    binary = client.files.create(
        file=("img.png", b"\x89PNG\r\n\x1a\n\x00\xff\xfe"), purpose="batch"
    )
    failed = client.batches.create(
        input_file_id=binary.id, endpoint=COMPLETIONS, completion_window="24h"
    )
    assert failed.status == "failed" and failed.errors is not None and failed.errors.data
    with httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {key}"}) as http:
        assert http.get("/v1/jobs").json()["data"] == []
