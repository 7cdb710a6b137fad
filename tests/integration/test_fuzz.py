"""Schemathesis fuzzes every operation of inferq's own OpenAPI document over HTTP.

Each operation gets valid and invalid requests (bodies, queries, headers, path ids) drawn from
the document with a fixed derandomized seed, sent to the live stack with a real key; each
answer must be no server error, carry a declared status code and content type, and match the
declared schema. The job endpoints run real jobs on the engine, so every generated max_tokens
is cut to a few tokens and long polls to a second.

Not fuzzed: the WebSocket `/v1/ws` (not an OpenAPI operation; `test_streams.py` drives it) and
`/metrics` (not in the document). The SSE streams are fuzzed like any other operation: they
end after their job's final event, and unknown ids are 404 before any stream starts.
"""

from __future__ import annotations

import re
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


@pytest.fixture(scope="module")
def fuzz_key(stack: Stack) -> str:
    """One key for every fuzz request: its jobs and files are this owner's alone."""
    return stack.create_key(Tier.STANDARD)


def _bounded(value: Any) -> Any:
    """`value` with every numeric max_tokens cut to a few tokens, so fuzz jobs cost no time."""
    if isinstance(value, dict):
        return {
            key: min(item, MAX_TOKENS)
            if key in ("max_tokens", "max_completion_tokens") and _is_number(item)
            else _bounded(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_bounded(item) for item in value]
    return value


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
