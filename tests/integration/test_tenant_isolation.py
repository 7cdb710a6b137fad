"""One owner's jobs, streams, files and batches do not exist for another owner, on any route.

Owner A makes one resource of each kind; owner B gets exactly what an unknown id gets (404,
same body but for the id) on every route that takes an id, and A's resources are unchanged
afterwards. The routes are read from the app, so a new route that takes an id fails
`test_every_route_that_takes_an_id_is_covered` until it is added here.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi.routing import APIWebSocketRoute
from websockets.sync.client import connect

from api.app import create_app
from core.tiers import Tier
from tests.support import Stack, wait_final

APP = create_app()
DOCUMENT = APP.openapi()
UNKNOWN = "zz-unknown-id"

ID_ROUTES = {
    ("GET", "/v1/jobs/{job_id}"): "job",
    ("DELETE", "/v1/jobs/{job_id}"): "job",
    ("GET", "/v1/jobs/{job_id}/events"): "job",
    ("POST", "/v1/jobs/{job_id}/feedback"): "job",
    ("GET", "/v1/files/{file_id}"): "file",
    ("GET", "/v1/files/{file_id}/content"): "file",
    ("DELETE", "/v1/files/{file_id}"): "file",
    ("GET", "/v1/batches/{batch_id}"): "batch",
    ("POST", "/v1/batches/{batch_id}/cancel"): "batch",
    ("GET", "/v1/qa-batches/{batch_id}"): "qa_batch",
    ("GET", "/v1/qa-batches/{batch_id}/results"): "qa_batch",
    ("POST", "/v1/qa-batches/{batch_id}/cancel"): "qa_batch",
}
"""Every route with an id in its path, and which of A's resources it is tried on."""

BODIES = {("POST", "/v1/jobs/{job_id}/feedback"): {"score": 1.0}}
"""What a route needs besides its id, so that only the id decides its answer."""

SHARED_ROUTES = {("GET", "/v1/models/{model_id}")}
"""Routes with an id that names no owner's resource: the served model is the same for all."""

LISTS = {"/v1/jobs": "job", "/v1/files": "file", "/v1/batches": "batch"}
"""Every list of an owner's resources, and the kind it lists."""

UNOWNED_GETS = {"/healthz", "/readyz", "/v1/models"}


@dataclass
class OwnerA:
    """One resource of each kind, made by owner A."""

    key: str
    ids: dict[str, str]
    input_file: str


def _ok(response: httpx.Response, status: int = 200) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    return body


@pytest.fixture(scope="module")
def owner_a(stack: Stack) -> OwnerA:
    """Owner A with an ended job, a document file, an OpenAI batch and a Q&A batch."""
    key = stack.create_key(Tier.STANDARD)
    with stack.client(key) as client:
        job = stack.submit(key, prompt="Owner A's job.", max_tokens=2)
        wait_final(client, job["id"])
        document = client.post(
            "/v1/files",
            files={"file": ("a.txt", b"Owner A's document says nothing.")},
            data={"purpose": "user_data"},
        )
        line = {
            "custom_id": "a-1",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": stack.model_name, "prompt": "A", "max_tokens": 2},
        }
        upload = client.post(
            "/v1/files",
            files={"file": ("a.jsonl", (json.dumps(line) + "\n").encode())},
            data={"purpose": "batch"},
        )
        input_file = _ok(upload)["id"]
        batch = client.post(
            "/v1/batches",
            json={
                "input_file_id": input_file,
                "endpoint": "/v1/completions",
                "completion_window": "24h",
            },
        )
        qa = client.post(
            "/v1/qa-batches",
            json={"document": "Owner A's contract.", "questions": ["Who?"], "max_tokens": 2},
        )
        ids = {
            "job": job["id"],
            "file": _ok(document)["id"],
            "batch": _ok(batch)["id"],
            "qa_batch": _ok(qa, 202)["id"],
        }
    return OwnerA(key, ids, input_file)


def _operations() -> Iterator[tuple[str, str]]:
    for path, operations in DOCUMENT["paths"].items():
        for method in operations:
            yield method.upper(), path


def test_every_route_that_takes_an_id_is_covered() -> None:
    with_id = {(method, path) for method, path in _operations() if "{" in path}
    missing = with_id - set(ID_ROUTES) - SHARED_ROUTES
    assert not missing, f"add these routes to ID_ROUTES (or SHARED_ROUTES): {sorted(missing)}"
    assert set(ID_ROUTES) <= with_id, "ID_ROUTES names a route the app no longer has"
    gets = {path for method, path in _operations() if method == "GET" and "{" not in path}
    assert gets - UNOWNED_GETS == set(LISTS), "a new list endpoint: add it to LISTS"
    sockets = [route.path for route in APP.routes if isinstance(route, APIWebSocketRoute)]
    assert sockets == ["/v1/ws"], "a new WebSocket route: check it for isolation here"


def _same_as_unknown(client: httpx.Client, method: str, template: str, own_id: str) -> None:
    def call(resource_id: str) -> httpx.Response:
        url = re.sub(r"\{[^}]+\}", resource_id, template)
        return client.request(method, url, json=BODIES.get((method, template)))

    theirs, unknown = call(own_id), call(UNKNOWN)
    assert unknown.status_code == 404, (method, template, unknown.text)
    assert theirs.status_code == 404, (method, template, theirs.text)
    assert theirs.text.replace(own_id, "<id>") == unknown.text.replace(UNKNOWN, "<id>")
    assert theirs.headers["content-type"] == unknown.headers["content-type"]


def test_another_owner_gets_404_on_every_route_with_an_id(stack: Stack, owner_a: OwnerA) -> None:
    key_b = stack.create_key(Tier.STANDARD)
    with stack.client(key_b) as client:
        for (method, template), kind in ID_ROUTES.items():
            _same_as_unknown(client, method, template, owner_a.ids[kind])
    # B's DELETE and cancel calls changed nothing of A's.
    with stack.client(owner_a.key) as client:
        job = _ok(client.get(f"/v1/jobs/{owner_a.ids['job']}"))
        assert job["status"] == "succeeded" and job["feedback_score"] is None
        assert client.get(f"/v1/files/{owner_a.ids['file']}/content").content.startswith(b"Owner")
        batch = _ok(client.get(f"/v1/batches/{owner_a.ids['batch']}"))
        assert batch["status"] not in ("cancelling", "cancelled"), batch
        qa = _ok(client.get(f"/v1/qa-batches/{owner_a.ids['qa_batch']}"))
        assert qa["status"] != "cancelled" and not qa["counts"].get("cancelled"), qa


def test_another_owners_lists_show_none_of_its_resources(stack: Stack, owner_a: OwnerA) -> None:
    key_b = stack.create_key(Tier.STANDARD)
    stack.submit(key_b, prompt="Owner B's job.", max_tokens=2)
    with stack.client(key_b) as client:
        for path, kind in LISTS.items():
            listed = json.dumps(_ok(client.get(path)))
            assert owner_a.ids[kind] not in listed, path
            assert owner_a.input_file not in listed, path
        for path, kind in (("/v1/files", "file"), ("/v1/batches", "batch")):
            after_theirs = client.get(path, params={"after": owner_a.ids[kind]})
            after_unknown = client.get(path, params={"after": UNKNOWN})
            assert after_theirs.status_code == after_unknown.status_code == 400
            assert after_theirs.text.replace(owner_a.ids[kind], "<id>") == (
                after_unknown.text.replace(UNKNOWN, "<id>")
            )
    with stack.client(owner_a.key) as client:
        assert owner_a.ids["job"] in json.dumps(_ok(client.get("/v1/jobs")))


def test_another_owners_file_cannot_feed_a_batch(stack: Stack, owner_a: OwnerA) -> None:
    requests = {
        "/v1/batches": {"endpoint": "/v1/completions", "completion_window": "24h"},
        "/v1/qa-batches": {"questions": ["Who?"], "max_tokens": 2},
    }
    fields = {"/v1/batches": "input_file_id", "/v1/qa-batches": "document_file_id"}
    with stack.client(stack.create_key(Tier.STANDARD)) as client:
        for path, body in requests.items():
            file_id = owner_a.ids["file"] if path == "/v1/qa-batches" else owner_a.input_file
            theirs = client.post(path, json={fields[path]: file_id, **body})
            unknown = client.post(path, json={fields[path]: UNKNOWN, **body})
            assert theirs.status_code == unknown.status_code == 404, theirs.text
            assert theirs.text.replace(file_id, "<id>") == unknown.text.replace(UNKNOWN, "<id>")


def test_an_idempotency_key_is_per_owner(stack: Stack) -> None:
    headers = {"Idempotency-Key": f"shared-{uuid.uuid4().hex}"}
    body = {"prompt": "Same request.", "max_tokens": 2}
    jobs = []
    for _ in range(2):
        with stack.client(stack.create_key(Tier.STANDARD)) as client:
            response = client.post("/v1/jobs", json=body, headers=headers)
            jobs.append(_ok(response, 202)["id"])
    assert jobs[0] != jobs[1]


def test_another_owners_job_is_unknown_on_the_websocket(stack: Stack, owner_a: OwnerA) -> None:
    url = stack.api_url.replace("http://", "ws://") + "/v1/ws"
    headers = {"X-API-Key": stack.create_key(Tier.STANDARD)}
    errors: dict[str, dict[str, Any]] = {}
    with connect(url, additional_headers=headers, open_timeout=30) as ws:
        for kind in ("subscribe", "cancel"):
            for job_id in (owner_a.ids["job"], UNKNOWN):
                ws.send(json.dumps({"type": kind, "ref": f"{kind}:{job_id}", "job_id": job_id}))
        deadline = time.monotonic() + 30
        while len(errors) < 4 and time.monotonic() < deadline:
            message = json.loads(ws.recv(timeout=30))
            assert message["type"] == "error", message  # nothing of A's is ever sent to B
            errors[message["ref"]] = message["error"]
    for kind in ("subscribe", "cancel"):
        theirs, unknown = errors[f"{kind}:{owner_a.ids['job']}"], errors[f"{kind}:{UNKNOWN}"]
        assert theirs["code"] == unknown["code"] == "not_found"
        assert theirs["message"].replace(owner_a.ids["job"], "<id>") == unknown["message"].replace(
            UNKNOWN, "<id>"
        )
