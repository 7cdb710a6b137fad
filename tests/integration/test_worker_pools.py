"""Worker pools by tier: a worker started with `--tiers` takes those tiers' jobs and no others.

This is what lets a deployment keep a pool for premium work and scale a pool of basic workers
down to zero (deploy/kubernetes): the basic pool never holds a premium job, and publishes no
room for one, so admission control does not count its slots for premium.
"""

from __future__ import annotations

import pytest
from sqlalchemy import select

from core import keys
from core.models import Job
from core.tiers import Tier
from core.workerinfo import live_workers
from tests.support import ExtraWorker, Stack, wait_final, worker_paused

POOL = "basic-pool@inferq-test"


def _worker_of(stack: Stack, job_id: str) -> str | None:
    with stack.db.session() as session:
        return session.scalar(select(Job.worker).where(Job.id == job_id))


@pytest.mark.timeout(600)
def test_a_worker_that_takes_basic_jobs_only_leaves_premium_ones_to_others(stack: Stack) -> None:
    premium, basic = stack.create_key(Tier.PREMIUM), stack.create_key(Tier.BASIC)
    pool = ExtraWorker(stack, POOL, concurrency=4, args=["--tiers", "basic"])
    with pool.running(), stack.client(premium) as client, stack.client(basic) as basic_client:
        stats = live_workers(stack.redis)[POOL]
        assert stats[keys.worker_takes_field(Tier.BASIC)] == 1
        assert stats[keys.worker_takes_field(Tier.PREMIUM)] == 0
        assert stats[keys.worker_room_field(Tier.PREMIUM)] == 0
        assert stats[keys.worker_room_field(Tier.BASIC)] == 4  # no share kept for tiers above
        with worker_paused(stack):  # only the pool takes jobs
            waiting = stack.submit(premium, prompt="Premium, please.", max_tokens=4)
            jobs = [stack.submit(basic, prompt=f"Basic {i}.", max_tokens=4) for i in range(3)]
            done = [wait_final(basic_client, job["id"]) for job in jobs]
            assert [job["status"] for job in done] == ["succeeded"] * 3
            assert {_worker_of(stack, job["id"]) for job in done} == {POOL}
            assert client.get(f"/v1/jobs/{waiting['id']}").json()["status"] == "queued"
        # The stack's worker takes every tier again: the premium job runs there.
        ran = wait_final(client, waiting["id"])
    assert ran["status"] == "succeeded"
    assert _worker_of(stack, ran["id"]) == stack.worker_name
