"""Per-key quotas: past a limit a key gets 429 with Retry-After, and other keys do not notice."""

from __future__ import annotations

from core.apikeys import Quota
from core.tiers import Tier
from tests.support import BLOCKER_TOKENS, Stack, wait_final


def _post(stack: Stack, key: str, **body: object) -> tuple[int, dict[str, object], dict[str, str]]:
    with stack.client(key) as client:
        response = client.post("/v1/jobs", json={"prompt": "Quota.", "max_tokens": 4, **body})
    return response.status_code, response.json(), dict(response.headers)


def test_requests_per_minute_past_the_limit_get_429_while_another_key_goes_on(
    stack: Stack,
) -> None:
    limited = stack.create_key(Tier.STANDARD, quota=Quota(requests_per_minute=3))
    other = stack.create_key(Tier.STANDARD)
    before = stack.queue_lengths()
    assert [_post(stack, limited)[0] for _ in range(3)] == [202, 202, 202]
    status, body, headers = _post(stack, limited)
    assert status == 429
    assert body["error"]["code"] == "rate_limit_exceeded"  # type: ignore[index]
    assert "3 requests per minute" in body["error"]["message"]  # type: ignore[index]
    assert 1 <= int(headers["retry-after"]) <= 60
    assert _post(stack, other)[0] == 202
    # The refused request stored and enqueued nothing.
    with stack.client(limited) as client:
        assert len(client.get("/v1/jobs").json()["data"]) == 3
    assert sum(stack.queue_lengths().values()) <= sum(before.values()) + 4


def test_tokens_per_minute_count_prompt_and_completion(stack: Stack) -> None:
    limited = stack.create_key(Tier.STANDARD, quota=Quota(tokens_per_minute=100))
    assert _post(stack, limited, max_tokens=60)[0] == 202  # ~8 prompt tokens + 60
    status, body, headers = _post(stack, limited, max_tokens=60)
    assert status == 429 and "100 tokens per minute" in body["error"]["message"]  # type: ignore[index]
    assert int(headers["retry-after"]) >= 1
    # More than the whole minute's budget can never be admitted: a 400 naming the limit.
    status, body, _ = _post(stack, limited, max_tokens=200)
    assert status == 400
    assert body["error"]["code"] == "quota_exceeded"  # type: ignore[index]


def test_concurrent_jobs_past_the_limit_get_429_until_one_ends(stack: Stack) -> None:
    limited = stack.create_key(Tier.PREMIUM, quota=Quota(max_concurrent=1))
    status, first, _ = _post(stack, limited, max_tokens=BLOCKER_TOKENS, ignore_eos=True)
    assert status == 202
    status, body, headers = _post(stack, limited)
    assert status == 429 and "1 concurrent jobs" in body["error"]["message"]  # type: ignore[index]
    assert headers["retry-after"] == "1"
    with stack.client(limited) as client:
        assert client.delete(f"/v1/jobs/{first['id']}").json()["status"] == "cancelled"
        # Its final event freed the slot.
        status, second, _ = _post(stack, limited)
        assert status == 202
        assert wait_final(client, str(second["id"]))["status"] == "succeeded"
        # A finished job frees its slot too.
        assert _post(stack, limited)[0] == 202


def test_a_batch_is_admitted_whole_or_not_at_all(stack: Stack) -> None:
    limited = stack.create_key(Tier.STANDARD, quota=Quota(requests_per_minute=5))
    jobs = [{"prompt": f"Batch {i}.", "max_tokens": 2} for i in range(4)]
    with stack.client(limited) as client:
        assert client.post("/v1/jobs/batch", json={"jobs": jobs}).status_code == 202
        refused = client.post("/v1/jobs/batch", json={"jobs": jobs})
        assert refused.status_code == 429
        assert len(client.get("/v1/jobs").json()["data"]) == 4
        assert client.post("/v1/jobs", json=jobs[0]).status_code == 202
