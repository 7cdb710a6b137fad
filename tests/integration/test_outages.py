"""Outages of the services inferq stands on, under load: every accepted job still ends once.

Each test runs a stack of its own, on a Redis and a database of its own, so what it takes away
never reaches another test's stack, whatever order the tests run in.

- Redis restart: a Redis server of the test's own is stopped while jobs queue and run, and
  started again empty (it persists nothing, the harshest case). The API answers 503 meanwhile;
  the API, worker and scheduler recover without being restarted, and the scheduler puts the
  queued jobs whose messages Redis lost back on the queues.
- Database outage (PostgreSQL): the job database refuses every connection for a few seconds.
  The API answers 503; workers retry their writes and their job starts; nothing is lost.
- Redis failing just after jobs were stored: they are accepted, and sent once it is back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import redis
from sqlalchemy.engine import make_url

from core.queue.app import make_celery_app
from core.queue.dispatch import Dispatcher, QueuedJob
from core.queue.routing import waiting_counts
from core.settings import Settings
from core.tiers import Tier
from tests.otlp import OtlpReceiver
from tests.stacks import running_stack
from tests.support import (
    BLOCKER_TOKENS,
    FINAL_EVENTS,
    POSTGRES_ADMIN_URL,
    WORKER_CONCURRENCY,
    RedisServer,
    Stack,
    postgres_database,
    read_sse,
    redis_server,
    wait_final,
)

JOBS = 48
"""More than the worker's 32 slots: some jobs run and the rest wait in the queue."""
TOKENS = 96
LONG_TOKENS = 1000
"""Long enough (standard's cap is 1024) that the first jobs still run when an outage begins."""
OUTAGE_S = 4


def _submit_many(
    stack: Stack, key: str, label: str, count: int, tokens: int = TOKENS
) -> list[dict[str, Any]]:
    return [
        stack.submit(key, prompt=f"{label}, job {i}.", max_tokens=tokens, ignore_eos=True)
        for i in range(count)
    ]


def _wait_running(stack: Stack, engine_requests_before: int, timeout_s: float = 120) -> None:
    """Until the worker has handed jobs submitted since it had made `engine_requests_before`
    engine requests to its engine. (Its in-flight count can miss them: on a fast host all 48
    can end between two of its once-a-second updates. Its peak can be an earlier test's.)"""
    deadline = time.monotonic() + timeout_s
    while stack.worker_stats()["engine_requests"] <= engine_requests_before:
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
        assert done["usage"]["completion_tokens"] == job["sampling_params"]["max_tokens"]
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
def _database(kind: str, tmp: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{tmp / 'inferq.db'}"
    else:
        with postgres_database() as url:
            yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def own_stack(
    request: pytest.FixtureRequest, tmp_path: Path, model_dir: Path, otlp: OtlpReceiver
) -> Iterator[tuple[Stack, RedisServer]]:
    """A stack on a Redis server and a database of its own, which the test may take away."""
    (tmp_path / "stack").mkdir()
    with (
        redis_server(tmp_path) as server,
        _database(request.param, tmp_path) as database_url,
        running_stack(tmp_path / "stack", server.url, database_url, model_dir, otlp.url) as stack,
    ):
        yield stack, server


def test_redis_restart_under_load_loses_nothing(own_stack: tuple[Stack, RedisServer]) -> None:
    stack, redis_service = own_stack
    key = stack.create_key(Tier.STANDARD)
    pids = {name: process.pid for name, process in stack.local.processes}
    with stack.client(key) as client:
        before = stack.worker_stats()["engine_requests"]
        accepted = _submit_many(stack, key, "Before the restart", JOBS)
        _wait_running(stack, before)
        redis_service.stop()
        try:
            _refused_quickly(client)
            assert client.get("/healthz").status_code == 200
            assert client.get("/readyz").status_code == 503
            time.sleep(OUTAGE_S)
        finally:
            redis_service.start()
            stack.redis.connection_pool.disconnect()  # the test's own connections went stale
        accepted += [
            _submit_after_outage(stack, client, f"After the restart, {i}.") for i in range(4)
        ]
        _assert_each_ended_once(stack, client, accepted)
    _assert_processes_alive(stack, pids)
    _assert_premium_still_goes_first(stack)


def _assert_premium_still_goes_first(stack: Stack) -> None:
    """The worker that lived through the outage still takes a premium job before basic ones.

    Its slots are filled with long jobs, a backlog of basic jobs and then a premium one wait,
    and the long jobs are cancelled one by one: each freed slot takes the best job waiting.
    """
    premium_key, basic_key = stack.create_key(Tier.PREMIUM), stack.create_key(Tier.BASIC)
    long = {"max_tokens": BLOCKER_TOKENS, "ignore_eos": True}
    blockers = [
        stack.submit(premium_key, prompt=f"Blocker {i}", **long) for i in range(WORKER_CONCURRENCY)
    ]
    _wait_full(stack)
    short = {"max_tokens": 16, "ignore_eos": True}
    basic = [stack.submit(basic_key, prompt=f"Basic {i}", **short) for i in range(12)]
    premium = stack.submit(premium_key, prompt="Premium", **short)
    with stack.client(premium_key) as client:
        for job in blockers:
            assert client.delete(f"/v1/jobs/{job['id']}").status_code in (200, 202, 409)
        premium_start = _started(wait_final(client, premium["id"]))
    with stack.client(basic_key) as client:
        basic_starts = [_started(wait_final(client, job["id"])) for job in basic]
    assert sum(start < premium_start for start in basic_starts) <= 1, (premium_start, basic_starts)


def _wait_full(stack: Stack, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while stack.worker_stats()["in_flight"] < WORKER_CONCURRENCY:
        assert time.monotonic() < deadline, f"the worker did not fill: {stack.worker_stats()}"
        time.sleep(0.2)


def _started(job: dict[str, Any]) -> datetime:
    assert job["status"] == "succeeded", job
    return datetime.fromisoformat(job["created_at"]) + timedelta(seconds=job["timings"]["queue_s"])


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


@pytest.mark.parametrize("own_stack", ["postgresql"], indirect=True)
def test_database_outage_loses_nothing(own_stack: tuple[Stack, RedisServer]) -> None:
    stack, _ = own_stack
    key = stack.create_key(Tier.STANDARD)
    pids = {name: process.pid for name, process in stack.local.processes}
    with stack.client(key) as client:
        before = stack.worker_stats()["engine_requests"]
        accepted = _submit_many(stack, key, "Before the outage", JOBS, LONG_TOKENS)
        _wait_running(stack, before)
        with _database_refusing_connections(stack.database_url):
            # Outlast a generation, so the worker has a result to store while the database
            # is out (no job can start meanwhile: starting one needs the database).
            running = stack.worker_stats()["in_flight"]
            assert running > 0, "every job ended before the outage began"
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
