"""Schemathesis fuzzes every operation of inferq's own OpenAPI document over HTTP.

Each operation gets valid and invalid requests (bodies, queries, headers, path ids) drawn from
the document with a fixed derandomized seed, sent to the live stack with a real key; each
answer must be no server error, carry a declared status code and content type, and match the
declared schema. The job endpoints run real jobs on the engine, so every generated max_tokens
is cut to a few tokens, every valid list of jobs or questions to a few items, and long polls
(`wait`) to a second; the module ends once the fuzz owner's jobs have all ended.

Not fuzzed by Schemathesis: the WebSocket `/v1/ws` (not an OpenAPI operation; `test_streams.py`
drives it, and the NUL test below sends it bad ids) and `/metrics` (not in the document).
MessagePack bodies are not generated (the document declares JSON). The SSE streams are fuzzed
like any other operation: they end after their job's final event, and unknown ids are 404
before any stream starts. The tests beside it pin down what fuzzing and probing found.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from websockets.sync.client import connect

from api.app import create_app
from core.tiers import Tier
from tests.support import Stack

DOCUMENT = create_app().openapi()
schema = schemathesis.openapi.from_dict(DOCUMENT)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
MAX_TOKENS = 4
MAX_WAIT_S = 1.0
MAX_JOBS_PER_REQUEST = 3
LIST_LIMITS = {
    name: prop["maxItems"]
    for component in DOCUMENT["components"]["schemas"].values()
    for name, prop in component.get("properties", {}).items()
    if "maxItems" in prop
}
"""Lists of jobs to make (`jobs`, `questions`) and the most items a valid one may have."""


@pytest.fixture(scope="module")
def fuzz_key(stack: Stack) -> Iterator[str]:
    """One key for every fuzz request; its jobs have all ended before the next module runs."""
    key = stack.create_key(Tier.STANDARD)
    yield key
    deadline = time.monotonic() + 120
    with stack.client(key) as client:
        while any(
            client.get("/v1/jobs", params={"status": status, "limit": 1}).json()["data"]
            for status in ("queued", "running")
        ):
            assert time.monotonic() < deadline, "the fuzz jobs did not end within 120 s"
            time.sleep(0.5)


def _bounded(value: Any) -> Any:
    """`value` with every max_tokens cut to a few tokens and every valid list of jobs to a few
    jobs (the coverage phase sends the longest lists allowed), so fuzz jobs cost no time."""
    if isinstance(value, dict):
        return {key: _bounded_field(key, item) for key, item in value.items()}
    if isinstance(value, list):
        return [_bounded(item) for item in value]
    return value


def _bounded_field(key: str, value: Any) -> Any:
    if key in ("max_tokens", "max_completion_tokens") and _is_number(value):
        return min(value, MAX_TOKENS)
    if key in LIST_LIMITS and isinstance(value, list) and len(value) <= LIST_LIMITS[key]:
        return _bounded(value[:MAX_JOBS_PER_REQUEST])
    return _bounded(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _bound_costs(case: schemathesis.Case) -> None:
    case.body = _bounded(case.body)
    wait = (case.query or {}).get("wait")
    if _is_number(wait) and wait > MAX_WAIT_S:
        case.query["wait"] = MAX_WAIT_S


def test_the_served_document_is_the_one_fuzzed(stack: Stack) -> None:
    served = httpx.get(f"{stack.api_url}/openapi.json", timeout=30)
    assert served.status_code == 200
    assert served.json() == DOCUMENT


def test_an_undeclared_method_is_405_with_the_paths_methods_in_allow(
    stack: Stack, fuzz_key: str
) -> None:
    # Schemathesis' CLI (`-c all`) found 405s without Allow, and Allow naming only one route's
    # methods where a path has several (GET and DELETE on a job).
    with stack.client(fuzz_key) as client:
        for path, operations in DOCUMENT["paths"].items():
            url = re.sub(r"\{[^}]+\}", "some-id", path)
            response = client.request("PUT", url)
            assert response.status_code == 405, (path, response.text)
            assert response.json()["error"]["code"] == "method_not_allowed"
            allowed = response.headers["allow"].split(", ")
            assert allowed == sorted(method.upper() for method in operations), path


def test_a_nul_character_is_a_400_wherever_a_client_can_send_one(
    stack: Stack, fuzz_key: str
) -> None:
    # Found by probing the PostgreSQL stack: PostgreSQL cannot compare or store text with a
    # NUL, so ids, filters and file names with one were 500s there (and 404s on SQLite).
    with stack.client(fuzz_key) as client:
        for path, operations in DOCUMENT["paths"].items():
            for method, operation in operations.items():
                url = re.sub(r"\{[^}]+\}", "id%00", path)
                if "{" in path:
                    assert client.request(method, url).status_code == 400, (method, path)
                for param in operation.get("parameters", []):
                    if param["in"] == "query" and param["schema"].get("type") != "boolean":
                        url = re.sub(r"\{[^}]+\}", "some-id", path) + f"?{param['name']}=a%00"
                        response = client.request(method, url)
                        assert response.status_code == 400, (method, path, param["name"])
        for path, body in (
            ("/v1/qa-batches", {"document_file_id": "file-\x00", "questions": ["Who?"]}),
            ("/v1/batches", {"input_file_id": "file-\x00", "endpoint": "/v1/completions"}),
        ):
            response = client.post(path, json={"completion_window": "24h", **body})
            assert response.status_code == 400, response.text
        upload = client.post(
            "/v1/files",
            content=_multipart_with_filename(b"a\x00b.txt", b"Some text."),
            headers={"Content-Type": "multipart/form-data; boundary=fuzz"},
        )
        assert upload.status_code == 200, upload.text
        assert upload.json()["filename"] == "ab.txt"
    url = stack.api_url.replace("http://", "ws://") + "/v1/ws"
    with connect(url, additional_headers={"X-API-Key": fuzz_key}, open_timeout=30) as ws:
        for kind in ("subscribe", "cancel"):
            ws.send(json.dumps({"type": kind, "ref": kind, "job_id": "job_\x00"}))
            answer = json.loads(ws.recv(timeout=30))
            assert answer["type"] == "error" and answer["ref"] == kind, answer
            assert answer["error"]["code"] == "invalid_request"


def _multipart_with_filename(filename: bytes, content: bytes) -> bytes:
    return (
        b'--fuzz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nuser_data\r\n'
        b'--fuzz\r\nContent-Disposition: form-data; name="file"; filename="'
        + filename
        + b'"\r\nContent-Type: text/plain\r\n\r\n'
        + content
        + b"\r\n--fuzz--\r\n"
    )


@schema.parametrize()
@settings(
    max_examples=25,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_every_operation_answers_as_documented(
    case: schemathesis.Case, stack: Stack, fuzz_key: str
) -> None:
    _bound_costs(case)
    case.call_and_validate(
        base_url=stack.api_url,
        headers={"Authorization": f"Bearer {fuzz_key}"},
        checks=CHECKS,
        timeout=60,
    )
