"""Bad input gets a clear 4xx with a stable code, and nothing is stored or enqueued."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.tiers import Tier
from tests.support import Stack

CASES: list[tuple[str, Any, int, str]] = [
    ("missing prompt", {"max_tokens": 5}, 400, "invalid_request"),
    ("empty prompt", {"prompt": ""}, 400, "invalid_request"),
    ("zero max_tokens", {"prompt": "x", "max_tokens": 0}, 400, "invalid_request"),
    ("negative max_tokens", {"prompt": "x", "max_tokens": -3}, 400, "invalid_request"),
    ("over the tier cap", {"prompt": "x", "max_tokens": 513}, 400, "tier_limit_exceeded"),
    ("longer timeout than the tier", {"prompt": "x", "timeout_s": 500}, 400, "tier_limit_exceeded"),
    ("prompt over the context", {"prompt": "word " * 4000}, 400, "context_length_exceeded"),
    ("prompt is a number", {"prompt": 42}, 400, "invalid_request"),
    ("max_tokens is a string", {"prompt": "x", "max_tokens": "5"}, 400, "invalid_request"),
    ("temperature is a word", {"prompt": "x", "temperature": "hot"}, 400, "invalid_request"),
    ("an empty stop sequence", {"prompt": "x", "stop": ""}, 400, "invalid_request"),
    ("an empty stop in a list", {"prompt": "x", "stop": ["end", ""]}, 400, "invalid_request"),
    ("unknown field", {"prompt": "x", "priority": 100}, 400, "invalid_request"),
    ("not an object", ["x"], 400, "invalid_request"),
]


def _assert_nothing_enqueued(stack: Stack, key: str, before: dict[str, int]) -> None:
    assert stack.queue_lengths() == before
    with stack.client(key) as client:
        assert client.get("/v1/jobs").json()["data"] == []


@pytest.mark.parametrize(("case", "body", "status", "code"), CASES, ids=[c[0] for c in CASES])
def test_invalid_job_is_rejected_and_not_enqueued(
    stack: Stack, case: str, body: Any, status: int, code: str
) -> None:
    key = stack.create_key(Tier.BASIC)
    before = stack.queue_lengths()
    with stack.client(key) as client:
        response = client.post("/v1/jobs", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert error["message"]
    _assert_nothing_enqueued(stack, key, before)


def test_tier_cap_error_names_the_limit(stack: Stack) -> None:
    key = stack.create_key(Tier.BASIC)
    with stack.client(key) as client:
        response = client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 9999})
    assert "512" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "max_tokens"


def test_body_over_one_mebibyte_is_413(stack: Stack) -> None:
    key = stack.create_key()
    before = stack.queue_lengths()
    body = json.dumps({"prompt": "a" * (1024 * 1024 + 10)})
    with stack.client(key) as client:
        declared = client.post(
            "/v1/jobs", content=body, headers={"Content-Type": "application/json"}
        )
        streamed = client.post(
            "/v1/jobs",
            content=iter([body[i : i + 65536].encode() for i in range(0, len(body), 65536)]),
            headers={"Content-Type": "application/json"},
        )
    for response in (declared, streamed):
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
    _assert_nothing_enqueued(stack, key, before)


def test_missing_and_unknown_keys_get_the_same_401(stack: Stack) -> None:
    before = stack.queue_lengths()
    body = {"prompt": "x"}
    with stack.client(None) as client:
        missing = client.post("/v1/jobs", json=body)
        unknown = client.post("/v1/jobs", json=body, headers={"Authorization": "Bearer iq_nope"})
        unknown_header = client.post("/v1/jobs", json=body, headers={"X-API-Key": "iq_nope"})
        invalid_body_no_key = client.post("/v1/jobs", json={"prompt": 5})
    for response in (missing, unknown, unknown_header, invalid_body_no_key):
        assert response.status_code == 401
        assert response.json() == missing.json()
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert stack.queue_lengths() == before


def test_revoked_key_gets_the_same_401(stack: Stack) -> None:
    from core.apikeys import KeyStore

    store = KeyStore(stack.db)
    key, record = store.create("revoked-owner", Tier.BASIC)
    assert store.revoke(record.id)
    with stack.client(key) as client:
        response = client.get("/v1/jobs")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_keys_are_stored_hashed(stack: Stack) -> None:
    from sqlalchemy import text

    key = stack.create_key()
    with stack.db.engine.connect() as conn:
        rows = [tuple(map(str, row)) for row in conn.execute(text("SELECT * FROM api_keys"))]
    assert rows
    assert not any(key in value for row in rows for value in row)


def test_unknown_job_is_404_everywhere(stack: Stack) -> None:
    key = stack.create_key()
    with stack.client(key) as client:
        for response in (
            client.get("/v1/jobs/job_doesnotexist"),
            client.get("/v1/jobs/job_doesnotexist", params={"wait": 1}),
            client.delete("/v1/jobs/job_doesnotexist"),
        ):
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "not_found"


def test_bad_query_parameters_are_400(stack: Stack) -> None:
    key = stack.create_key()
    with stack.client(key) as client:
        assert client.get("/v1/jobs", params={"cursor": "garbage!"}).status_code == 400
        assert client.get("/v1/jobs", params={"limit": 0}).status_code == 400
        assert client.get("/v1/jobs", params={"status": "sleeping"}).status_code == 400
        assert client.get("/v1/jobs/x", params={"wait": 1000}).status_code == 400
