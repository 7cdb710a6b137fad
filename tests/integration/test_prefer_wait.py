"""`Prefer: wait=N` on submission: the finished job in the answer, or the job as it stands."""

from __future__ import annotations

import time

from core.tiers import Tier
from tests.support import BLOCKER_TOKENS, Stack, wait_final


def test_a_job_submitted_with_prefer_wait_comes_back_finished(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    with stack.client(key) as client:
        response = client.post(
            "/v1/jobs",
            json={"prompt": "Answer at once.", "max_tokens": 12, "ignore_eos": True},
            headers={"Prefer": "wait=60"},
        )
        assert response.status_code == 200, response.text
        job = response.json()
        polled = client.get(f"/v1/jobs/{job['id']}").json()
    assert response.headers["Preference-Applied"] == "wait=60"
    assert response.headers["Location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] == "succeeded"
    assert job["usage"]["completion_tokens"] == 12
    assert job["text"] == polled["text"]
    assert job == polled


def test_a_job_still_running_when_the_wait_ends_is_answered_as_it_stands(stack: Stack) -> None:
    key = stack.create_key(Tier.PREMIUM)
    with stack.client(key) as client:
        started = time.monotonic()
        response = client.post(
            "/v1/jobs",
            json={"prompt": "A long one.", "max_tokens": BLOCKER_TOKENS, "ignore_eos": True},
            headers={"Prefer": "wait=2"},
        )
        waited_s = time.monotonic() - started
        job = response.json()
        client.delete(f"/v1/jobs/{job['id']}")
        ended = wait_final(client, job["id"])
    assert response.status_code == 202, response.text
    assert response.headers["Preference-Applied"] == "wait=2"
    assert job["status"] in ("queued", "running")
    assert waited_s >= 1.5  # it did wait (generous: shared host)
    assert ended["status"] == "cancelled"


def test_a_batch_submitted_with_prefer_wait_comes_back_with_every_job_finished(
    stack: Stack,
) -> None:
    key = stack.create_key(Tier.STANDARD)
    body = {
        "jobs": [{"prompt": f"Item {i}", "max_tokens": 6, "ignore_eos": True} for i in range(5)]
    }
    with stack.client(key) as client:
        response = client.post("/v1/jobs/batch", json=body, headers={"Prefer": "wait=60"})
    assert response.status_code == 200, response.text
    assert response.headers["Preference-Applied"] == "wait=60"
    jobs = response.json()["data"]
    assert [job["status"] for job in jobs] == ["succeeded"] * 5
    assert all(job["usage"]["completion_tokens"] == 6 for job in jobs)


def test_without_a_usable_wait_preference_submission_answers_at_once(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    with stack.client(key) as client:
        answers = [
            client.post("/v1/jobs", json={"prompt": "Now.", "max_tokens": 4}, headers=headers)
            for headers in ({}, {"Prefer": "wait=soon"}, {"Prefer": "respond-async"})
        ]
        for answer in answers:
            wait_final(client, answer.json()["id"])
    assert [answer.status_code for answer in answers] == [202, 202, 202]
    assert all("Preference-Applied" not in answer.headers for answer in answers)
    assert all(answer.json()["status"] == "queued" for answer in answers)
