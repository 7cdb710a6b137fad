"""Outages of the services inferq stands on, under load: every accepted job still ends once.

Named to run last of the integration tests on each database.

- The Redis restart test under load (commit cf70aaf) is out of the suite for now: it passed on
  both databases alone, but restarting the session's shared Redis broke tests that ran after
  it (see the note of that stop); it needs a stack and Redis of its own.
- Database outage (PostgreSQL): the job database refuses every connection for a few seconds.
  The API answers 503; workers retry their writes and their job starts; nothing is lost.
- Redis failing just after jobs were stored: they are accepted, and sent once it is back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import redis
from sqlalchemy.engine import make_url

from core.settings import Settings
from core.tiers import Tier
from scheduler.dispatch import Dispatcher, QueuedJob
from scheduler.queues import make_celery_app
from scheduler.routing import waiting_counts
from tests.support import (
    FINAL_EVENTS,
    POSTGRES_ADMIN_URL,
    Stack,
    read_sse,
    redis_server,
    wait_final,
)

JOBS = 48
"""More than the worker's 32 slots: some jobs run and the rest wait in the queue."""
TOKENS = 96
OUTAGE_S = 4


def _submit_many(stack: Stack, key: str, label: str, count: int) -> list[dict[str, Any]]:
    return [
        stack.submit(key, prompt=f"{label}, job {i}.", max_tokens=TOKENS, ignore_eos=True)
        for i in range(count)
    ]


def _wait_running(stack: Stack, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while stack.worker_stats()["in_flight"] == 0:
        assert time.monotonic() < deadline, "no job started"
        time.sleep(0.2)


def _submit_after_outage(stack: Stack, client: httpx.Client, label: str) -> dict[str, Any]:
    """Submit once the API has reconnected (a request may meet a connection that went stale)."""
    deadline = time.monotonic() + 60
    while True:
        response = client.post(
            "/v1/jobs", json={"prompt": label, "max_tokens": TOKENS, "ignore_eos": True}
        )
        if response.status_code == 202:
            job: dict[str, Any] = response.json()
            return job
        assert response.status_code == 503, response.text
        assert time.monotonic() < deadline, f"the API did not recover: {response.text}"
        time.sleep(0.5)


def _refused_quickly(client: httpx.Client) -> None:
    """A submission during the outage gets a quick 503 with a stable code, not a hang."""
    started = time.monotonic()
    response = client.post("/v1/jobs", json={"prompt": "During the outage.", "max_tokens": 8})
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "service_unavailable"
    assert time.monotonic() - started < 15  # generous: the point is that it does not hang


def _assert_each_ended_once(stack: Stack, client: httpx.Client, jobs: list[dict[str, Any]]) -> None:
    for job in jobs:
        done = wait_final(client, job["id"], timeout_s=300)
        assert done["status"] == "succeeded", done
        assert done["usage"]["completion_tokens"] == TOKENS
        events = read_sse(client, job["id"])
        assert sum(event["type"] in FINAL_EVENTS for event in events) == 1, events[-3:]
        assert events[-1]["type"] == "done"
    listed = client.get("/v1/jobs", params={"limit": 100}).json()["data"]
    assert sorted(job["id"] for job in listed) == sorted(job["id"] for job in jobs)


def _assert_processes_alive(stack: Stack, pids: dict[str, int]) -> None:
    """Nothing was restarted: the same API, worker and scheduler processes are still up."""
    now = {name: process.pid for name, process in stack.local.processes if process.poll() is None}
    assert now == pids


@contextmanager
def _database_refusing_connections(database_url: str) -> Iterator[None]:
    """The job database refuses new connections and drops the open ones, until the block ends."""
    name = make_url(database_url).database
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )
        try:
            yield
        finally:
            admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_database_outage_loses_nothing(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    pids = {name: process.pid for name, process in stack.local.processes}
    with stack.client(key) as client:
        accepted = _submit_many(stack, key, "Before the outage", JOBS)
        _wait_running(stack)
        with _database_refusing_connections(stack.database_url):
            # Outlast a generation, so the worker has a result to store while the database
            # is out (no job can start meanwhile: starting one needs the database).
            running = stack.worker_stats()["in_flight"]
            deadline = time.monotonic() + 120
            while stack.worker_stats()["in_flight"] >= running:
                assert time.monotonic() < deadline, "no generation ended during the outage"
                time.sleep(0.2)
            _refused_quickly(client)
            response = client.get(f"/v1/jobs/{accepted[0]['id']}")
            assert response.status_code == 503, response.text
            assert client.get("/healthz").status_code == 200
            assert client.get("/readyz").status_code == 503
            time.sleep(OUTAGE_S)
        accepted += [
            _submit_after_outage(stack, client, f"After the outage, {i}.") for i in range(4)
        ]
        _assert_each_ended_once(stack, client, accepted)
    _assert_processes_alive(stack, pids)


def test_jobs_stored_just_before_redis_fails_are_sent_once_it_is_back(tmp_path: Path) -> None:
    """A job committed when Redis fails is accepted: the dispatcher keeps it and sends it later."""
    with redis_server(tmp_path) as server:
        settings = Settings(redis_url=server.url, data_dir=tmp_path)
        client = redis.Redis.from_url(server.url)
        dispatcher = Dispatcher(settings, client, make_celery_app(settings))
        jobs = [QueuedJob(f"job_{i}", Tier.BASIC.value, "owner") for i in range(3)]
        server.stop()
        dispatcher.submit_or_defer(jobs)  # does not raise: the jobs are kept
        assert dispatcher.has_deferred()
        assert dispatcher.send_deferred() == 3  # still out: still kept
        server.start()
        assert dispatcher.send_deferred() == 0
        assert not dispatcher.has_deferred()
        assert waiting_counts(client)[Tier.BASIC.value] == 3
