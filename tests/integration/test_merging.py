"""Identical work is done once: merged while in flight, answered from the cache afterwards."""

from __future__ import annotations

import time
import uuid
from typing import Any

from core.tiers import Tier
from tests.support import Stack, read_sse, streamed_text, wait_final


def _unique(prefix: str) -> str:
    """A prompt no other test (or earlier run on the shared Redis) has sent."""
    return f"{prefix} {uuid.uuid4().hex[:8]}."


def _submit_batch(stack: Stack, key: str, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    with stack.client(key) as client:
        response = client.post("/v1/jobs/batch", json={"jobs": jobs})
        assert response.status_code == 202, response.text
        created: list[dict[str, Any]] = response.json()["data"]
        return created


def test_20_identical_concurrent_jobs_make_one_engine_request(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    before = stack.wait_idle()
    body = {"prompt": _unique("Merge me"), "max_tokens": 256, "temperature": 0, "ignore_eos": True}
    jobs = _submit_batch(stack, key, [body] * 20)
    with stack.client(key) as client:
        done = [wait_final(client, job["id"]) for job in jobs]
        streams = [streamed_text(read_sse(client, job["id"])) for job in jobs]
    after = stack.wait_idle()

    assert after["engine_requests"] - before["engine_requests"] == 1
    assert after["merged"] - before["merged"] == 19
    assert [job["status"] for job in done] == ["succeeded"] * 20
    assert sorted(job["served_from"] for job in done) == ["engine"] + ["merged"] * 19
    assert len({job["text"] for job in done}) == 1
    assert all(job["usage"]["completion_tokens"] == 256 for job in done)
    # Each job's own stream carries the whole text, also for those that joined mid-run.
    assert streams == [job["text"] for job in done]


def test_cancelling_one_merged_job_does_not_cancel_the_others(stack: Stack) -> None:
    key = stack.create_key(Tier.PREMIUM)
    body = {"prompt": _unique("Share me"), "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    first, second, third = _submit_batch(stack, key, [body] * 3)
    with stack.client(key) as client:
        read_sse(client, second["id"], until=lambda e: bool(e.get("text")))
        cancelled = client.delete(f"/v1/jobs/{second['id']}").json()
        assert cancelled["status"] == "cancelled"
        assert 0 < cancelled["usage"]["completion_tokens"] < 1000
        events = read_sse(client, second["id"])
        assert events[-1]["type"] == "cancelled"
        assert streamed_text(events) == cancelled["text"]

        finished = [wait_final(client, job["id"], timeout_s=180) for job in (first, third)]
    assert [job["status"] for job in finished] == ["succeeded", "succeeded"]
    assert all(job["usage"]["completion_tokens"] == 1000 for job in finished)
    assert finished[0]["text"] == finished[1]["text"]
    assert finished[0]["text"].startswith(cancelled["text"])


def test_a_repeated_deterministic_job_is_answered_from_the_cache(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    body = {"prompt": _unique("Cache me"), "max_tokens": 16, "seed": 11}
    with stack.client(key) as client:
        original = wait_final(client, stack.submit(key, **body)["id"])
        assert original["status"] == "succeeded" and original["served_from"] == "engine"
        before = stack.wait_idle()

        response = client.post("/v1/jobs", json=body)
        assert response.status_code == 202
        repeat = response.json()
        # Answered in the response itself: no queue, no engine.
        assert repeat["status"] == "succeeded" and repeat["served_from"] == "cache"
        assert repeat["text"] == original["text"]
        assert repeat["usage"]["completion_tokens"] == original["usage"]["completion_tokens"]
        events = read_sse(client, repeat["id"])
        assert [e["type"] for e in events][-1] == "done"
        assert streamed_text(events) == original["text"]

        # Opting out runs it again.
        fresh = wait_final(client, stack.submit(key, **body, cache=False)["id"])
        assert fresh["served_from"] == "engine"
        # Random sampling is never cached.
        random = dict(body, seed=None, temperature=1.0)
        sampled = wait_final(client, stack.submit(key, **random)["id"])
        again = client.post("/v1/jobs", json=random).json()
        assert sampled["served_from"] == "engine" and again["status"] == "queued"
        wait_final(client, again["id"])
    after = stack.wait_idle()
    assert after["engine_requests"] - before["engine_requests"] == 3


def test_questions_after_the_first_reuse_the_documents_cached_prefix(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    document = " ".join(
        f"Clause {i} of contract {uuid.uuid4().hex[:6]} says nothing." for i in range(60)
    )
    questions = [f"{document}\nQuestion {i}: what does it say?\nAnswer:" for i in range(6)]
    with stack.client(key) as client:
        first = wait_final(client, stack.submit(key, prompt=questions[0], max_tokens=8)["id"])
        time.sleep(0.5)
        rest = _submit_batch(stack, key, [{"prompt": q, "max_tokens": 8} for q in questions[1:]])
        answers = [wait_final(client, job["id"]) for job in rest]
    assert first["status"] == "succeeded"
    assert all(job["status"] == "succeeded" for job in answers)
    for job in answers:
        assert job["usage"]["cached_prompt_tokens"] > job["usage"]["prompt_tokens"] // 2, job
