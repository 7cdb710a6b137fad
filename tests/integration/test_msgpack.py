"""MessagePack on the job and batch endpoints: bodies in, responses out by Accept."""

from __future__ import annotations

from typing import Any

import httpx
import msgpack

from core.tiers import Tier
from tests.support import Stack

MSGPACK = "application/x-msgpack"
AS_MSGPACK = {"Content-Type": MSGPACK, "Accept": MSGPACK}


def _unpack(response: httpx.Response) -> Any:
    assert response.headers["content-type"] == MSGPACK, response.text
    return msgpack.unpackb(response.content)


def test_a_job_submitted_and_read_in_messagepack_matches_its_json(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    body = {"prompt": "Packed prompt, ü 漢字.", "max_tokens": 6, "temperature": 0.0}
    with stack.client(key) as client:
        created = client.post("/v1/jobs", content=msgpack.packb(body), headers=AS_MSGPACK)
        assert created.status_code == 202
        job = _unpack(created)
        assert job["status"] == "queued" and job["sampling_params"]["max_tokens"] == 6
        done = _unpack(
            client.get(f"/v1/jobs/{job['id']}", params={"wait": 60}, headers={"Accept": MSGPACK})
        )
        as_json = client.get(f"/v1/jobs/{job['id']}")
        listed = _unpack(client.get("/v1/jobs", headers={"Accept": MSGPACK}))
    assert done["status"] == "succeeded" and done["text"]
    assert as_json.headers["content-type"] == "application/json"
    assert done == as_json.json()
    assert [j["id"] for j in listed["data"]] == [job["id"]]


def test_batches_speak_messagepack_too(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    jobs = {"jobs": [{"prompt": f"Packed {i}.", "max_tokens": 2} for i in range(3)]}
    qa = {"document": "A short document.", "questions": ["One?", "Two?"], "max_tokens": 2}
    with stack.client(key) as client:
        batch = _unpack(
            client.post("/v1/jobs/batch", content=msgpack.packb(jobs), headers=AS_MSGPACK)
        )
        created = _unpack(
            client.post("/v1/qa-batches", content=msgpack.packb(qa), headers=AS_MSGPACK)
        )
        read = _unpack(client.get(f"/v1/qa-batches/{created['id']}", headers={"Accept": MSGPACK}))
    assert len(batch["data"]) == 3
    assert created["object"] == "qa_batch" and created["total"] == 2
    assert [a["question"] for a in read["answers"]] == ["One?", "Two?"]


def test_bad_messagepack_gets_the_same_json_errors_and_stores_nothing(stack: Stack) -> None:
    key = stack.create_key(Tier.BASIC)
    with stack.client(key) as client:
        garbage = client.post("/v1/jobs", content=b"\xc1\xc1", headers=AS_MSGPACK)
        wrong_type = client.post(
            "/v1/jobs",
            content=msgpack.packb({"prompt": "x", "max_tokens": "5"}),
            headers=AS_MSGPACK,
        )
        listed = client.get("/v1/jobs").json()["data"]
    for response in (garbage, wrong_type):
        assert response.status_code == 400
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error"]["code"] == "invalid_request"
    assert garbage.json()["error"]["param"] == "body"
    assert wrong_type.json()["error"]["param"] == "max_tokens"
    assert listed == []
