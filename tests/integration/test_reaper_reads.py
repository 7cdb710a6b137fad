"""The scheduler's tick reads every running job's lease, and every tick: in bulk, a few
commands however many jobs run, and a job whose worker still holds it stays where it is.

Real Redis and SQLite; no worker (the leases and the worker's name claim are set by hand).
"""

from __future__ import annotations

from pathlib import Path

import redis

from core import keys
from core.db import Database
from core.jobs import JobStore
from core.new_jobs import NewJob
from core.queue.app import make_celery_app
from core.settings import Settings
from migrations import upgrade
from scheduler.reaper import LEASES_PER_READ, Scheduler
from tests.support import command_calls, redis_server

RUNNING = LEASES_PER_READ + 200


def test_a_tick_reads_a_thousand_running_jobs_leases_in_a_few_commands(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        url = f"sqlite:///{tmp_path / 'reaper.db'}"
        upgrade(url)
        settings = Settings(redis_url=server.url, database_url=url)
        client = redis.Redis.from_url(server.url)
        store = JobStore(Database(url))
        jobs = store.create_many(
            [
                NewJob(
                    owner="reaper",
                    tier="basic",
                    prompt=f"Job {i}.",
                    sampling_params={"max_tokens": 4},
                    timeout_s=600,
                    prompt_tokens=3,
                )
                for i in range(RUNNING)
            ]
        )
        store.start_attempts({job.id: job.attempt for job in jobs}, worker="alive@inferq-test")
        client.set(keys.worker_name_claim("alive@inferq-test"), "process-token")
        client.mset({keys.job_lease(job.id): "process-token:1" for job in jobs})
        scheduler = Scheduler(settings, store, client, make_celery_app(settings))

        before = command_calls(client)
        report = scheduler.tick()
        calls = command_calls(client)

        assert report.requeued == [] and report.failed == []
        assert len(store.running()) == RUNNING
        # Two MGETs for the leases (a thousand at most each), one for the workers' claims.
        assert calls["mget"] - before.get("mget", 0) == 3
        assert calls.get("get", 0) - before.get("get", 0) < 10
