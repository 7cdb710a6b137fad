"""`POST /v1/jobs/batch`: many jobs in one request, all accepted or none."""

from __future__ import annotations

from api.schemas import MAX_BATCH_JOBS
from core.tiers import Tier
from tests.support import Stack, wait_final


def test_a_batch_is_queued_and_every_job_runs(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    body = {"jobs": [{"prompt": f"Batch item {i}", "max_tokens": 8} for i in range(3)]}
    with stack.client(key) as client:
        response = client.post("/v1/jobs/batch", json=body)
        assert response.status_code == 202, response.text
        jobs = response.json()["data"]
        done = [wait_final(client, job["id"]) for job in jobs]
        listed = client.get("/v1/jobs").json()["data"]
    assert [job["status"] for job in jobs] == ["queued"] * 3
    assert all(job["status"] == "succeeded" and job["tier"] == "standard" for job in done)
    assert [job["id"] for job in listed] == [job["id"] for job in reversed(jobs)]


def test_one_bad_job_rejects_the_whole_batch(stack: Stack) -> None:
    key = stack.create_key(Tier.BASIC)
    before = stack.queue_lengths()
    good = {"prompt": "fine", "max_tokens": 8}
    with stack.client(key) as client:
        over_cap = client.post(
            "/v1/jobs/batch", json={"jobs": [good, {"prompt": "x", "max_tokens": 9999}]}
        )
        wrong_type = client.post("/v1/jobs/batch", json={"jobs": [good, {"prompt": 3}]})
        empty = client.post("/v1/jobs/batch", json={"jobs": []})
        too_many = client.post("/v1/jobs/batch", json={"jobs": [good] * (MAX_BATCH_JOBS + 1)})
        listed = client.get("/v1/jobs").json()["data"]
    assert over_cap.status_code == 400
    assert over_cap.json()["error"]["code"] == "tier_limit_exceeded"
    assert over_cap.json()["error"]["param"] == "jobs[1].max_tokens"
    assert wrong_type.status_code == 400
    assert wrong_type.json()["error"]["param"] == "jobs.1.prompt"
    assert empty.status_code == 400
    assert too_many.status_code == 400
    assert listed == []
    assert stack.queue_lengths() == before
