"""Leases for a batch of jobs in one script call, on a real Redis: each job comes out as if it
had been claimed, renewed or released alone."""

from __future__ import annotations

import uuid
from pathlib import Path

import redis

from core import keys
from tests.support import command_calls, redis_server
from workers.leases import Leases


def _ids(n: int) -> list[str]:
    return [f"lease-test-{uuid.uuid4().hex}" for _ in range(n)]


def test_a_batch_claim_skips_jobs_held_elsewhere_and_reports_cancels(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    leases = Leases(client, ttl_s=30)
    free, held, cancelled = _ids(3)
    client.set(keys.job_lease(held), "other@host:1", px=30_000)
    client.set(keys.job_cancel_flag(cancelled), b"1", ex=60)

    tokens = {free: "me:1", held: "me:2", cancelled: "me:3"}
    claimed = leases.claimed(list(tokens), leases.claim(tokens, client))

    assert claimed == {free: False, cancelled: True}
    assert client.get(keys.job_lease(free)) == b"me:1"
    assert client.get(keys.job_lease(held)) == b"other@host:1"  # untouched
    assert 29_000 < client.pttl(keys.job_lease(cancelled)) <= 30_000
    assert leases.claim({}, client) == []


def test_a_batch_release_deletes_only_leases_still_held_with_their_tokens(
    redis_url: str,
) -> None:
    client = redis.Redis.from_url(redis_url)
    leases = Leases(client, ttl_s=30)
    mine, taken_over, gone = _ids(3)
    leases.claim({mine: "me:1", taken_over: "me:2"}, client)
    client.set(keys.job_lease(taken_over), "other@host:9", px=30_000)  # lapsed, claimed anew

    pipe = client.pipeline(transaction=False)
    leases.release([(mine, "me:1"), (taken_over, "me:2"), (gone, "me:3")], pipe)
    assert pipe.execute() == [1]

    assert client.get(keys.job_lease(mine)) is None
    assert client.get(keys.job_lease(taken_over)) == b"other@host:9"


def test_a_batch_renewal_extends_every_lease(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    leases = Leases(client, ttl_s=30)
    jobs = _ids(3)
    for job_id in jobs:
        client.set(keys.job_lease(job_id), "me", px=1_000)

    leases.renew(jobs, client)

    assert all(client.pttl(keys.job_lease(job_id)) > 29_000 for job_id in jobs)


def test_a_batch_costs_redis_a_set_per_job_and_a_command_or_two_besides(tmp_path: Path) -> None:
    """Claim and release once cost four commands a job (SET, EXISTS, GET, DEL); now the cancel
    flags come in one MGET, and the release is one MGET and one DEL."""
    with redis_server(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        leases = Leases(client, ttl_s=30)
        jobs = _ids(50)
        client.set(keys.job_cancel_flag(jobs[7]), b"1", ex=60)
        before = command_calls(client)
        tokens = {job_id: f"me:{i}" for i, job_id in enumerate(jobs)}
        claimed = leases.claimed(jobs, leases.claim(tokens, client))
        assert leases.release(list(tokens.items()), client) == 50
        calls = {name: n - before.get(name, 0) for name, n in command_calls(client).items()}
        assert [job_id for job_id, cancel in claimed.items() if cancel] == [jobs[7]]
        assert len(claimed) == 50
        assert not any(client.exists(keys.job_lease(job_id)) for job_id in jobs)
        assert {name: calls.get(name, 0) for name in ("set", "mget", "del", "get", "exists")} == {
            "set": 50,
            "mget": 2,
            "del": 1,
            "get": 0,
            "exists": 0,
        }
