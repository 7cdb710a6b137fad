"""Test harness: real Redis, SQLite or PostgreSQL, a Celery worker and the API, per session."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import psycopg
import redis

from core import keys
from core.apikeys import KeyStore, Quota
from core.db import Database
from core.events import streamed_text as fold_stream
from core.modelinfo import served_model_name
from core.queue.routing import waiting_counts
from core.redisconn import sync_client
from core.tiers import TIERS_BY_PRIORITY, Tier
from core.workerinfo import live_workers
from inferq.local import LocalStack, free_port, redis_reachable, redis_server_command

IN_CI = os.environ.get("CI", "").lower() == "true"
POSTGRES_ADMIN_URL = os.environ.get(
    "INFERQ_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
WORKER_CONCURRENCY = 32
BLOCKER_TOKENS = 16000
"""Long enough to keep a worker busy while a test builds a backlog (tens of seconds here)."""
LEASE_TTL_S = 20
"""The test stacks' job leases: shorter than the default 30 s, longer than the stalls of every
process at once (6 s, measured by a high-priority process that sleeps 50 ms at a time) that the
shared 2-vCPU test hosts have; a lease lapsed in one is not a lost job. A killed worker's jobs
are handed on through its name's claim, seconds after the kill, whatever this is."""
EXPERIMENT = {"variants": {"control": {"weight": 90}, "short": {"weight": 10, "max_tokens": 2}}}
"""The test stacks' A/B experiment, `greeting`: one user in ten gets two-token answers."""
FLOWER_AUTH = "inferq-test:flower-secret"
FINAL_STATES = ("succeeded", "failed", "cancelled", "timed_out")


class ServiceMissing(RuntimeError):
    """A service the tests need is not there; the test command should have started it."""


@dataclass
class RedisServer:
    """A Redis server for a test session; one the session started itself can be restarted."""

    url: str
    command: list[str] | None = None
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server (again, on the same port and with empty data: it persists none)."""
        assert self.command is not None, "a Redis the tests did not start cannot be restarted"
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL)
        for _ in range(200):
            if redis_reachable(self.url):
                return
            time.sleep(0.05)
        raise ServiceMissing("redis-server did not start")

    def stop(self) -> None:
        """Stop the server (SIGTERM) and wait until it has exited."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


@contextmanager
def redis_server(tmp: Path) -> Iterator[RedisServer]:
    """A Redis server of the test session's own on a free port (so tests may stop it)."""
    binary = shutil.which("redis-server")
    if binary is None:
        url = os.environ.get("INFERQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
        if not redis_reachable(url):
            raise ServiceMissing(f"no redis-server binary and no Redis at {url}")
        redis.Redis.from_url(url).flushdb()
        yield RedisServer(url)
        return
    port = free_port()
    server = RedisServer(
        f"redis://127.0.0.1:{port}/0", command=redis_server_command(binary, port, tmp)
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def postgres_database() -> Iterator[str]:
    """A fresh PostgreSQL database for one test session, dropped afterwards."""
    name = f"inferq_test_{uuid.uuid4().hex[:10]}"
    try:
        admin = psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        raise ServiceMissing(f"PostgreSQL at {POSTGRES_ADMIN_URL} is not reachable: {exc}") from exc
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = POSTGRES_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclass
class Stack:
    """A running inferq: API and one worker on real Redis and a real database."""

    api_url: str
    redis_url: str
    database_url: str
    model_dir: Path
    local: LocalStack
    worker_metrics_url: str
    redis: redis.Redis = field(init=False)

    def __post_init__(self) -> None:
        self.redis = sync_client(self.redis_url)
        self._clients: dict[str, httpx.Client] = {}

    @property
    def db(self) -> Database:
        """The database the stack writes to."""
        return Database(self.database_url)

    @property
    def model_name(self) -> str:
        """The name clients use for the stack's model."""
        return served_model_name(str(self.model_dir))

    def create_key(
        self, tier: Tier = Tier.STANDARD, owner: str | None = None, quota: Quota | None = None
    ) -> str:
        """A new key for a fresh owner (so tests never see each other's jobs)."""
        key, _ = KeyStore(self.db).create(owner or f"owner-{uuid.uuid4().hex[:8]}", tier, quota)
        return key

    def client(self, key: str | None, **kwargs: Any) -> httpx.Client:
        """An HTTP client on the API, authenticated with `key`."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.api_url, headers=headers, timeout=120, **kwargs)

    def submit(self, key: str, **body: Any) -> dict[str, Any]:
        """POST a job and return it; asserts 202.

        Reuses one client per key: making an httpx client costs tens of milliseconds of CPU,
        which tests that submit dozens of jobs to a busy machine cannot afford.
        """
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = self.client(key)
        response = client.post("/v1/jobs", json=body)
        assert response.status_code == 202, response.text
        job: dict[str, Any] = response.json()
        return job

    def forget_measured_load(self) -> None:
        """Drop the rates admission control measured, as on a freshly started system.

        A test about ordering builds a backlog on purpose; the starts and ends of earlier tests
        on the same stack would otherwise decide whether that backlog is admitted.
        """
        for kind in ("started", "finished", "run-ms"):
            for name in self.redis.scan_iter(match=f"{keys.PREFIX}:{kind}:*", count=1000):
                self.redis.delete(name)

    def queue_lengths(self) -> dict[str, int]:
        """Jobs waiting in each tier: queued (shared or routed) plus held back for fair share."""
        return waiting_counts(self.redis)

    @property
    def worker_name(self) -> str:
        """The node name of the stack's own worker."""
        return f"cpu@{socket.gethostname()}"

    def worker_stats(self, name: str | None = None) -> dict[str, int]:
        """A worker's counters (default: the stack's own worker)."""
        workers = live_workers(self.redis)
        name = name or self.worker_name
        assert name in workers, workers
        return workers[name]

    def wait_idle(self, timeout_s: float = 60) -> dict[str, int]:
        """Wait until the queues are empty and the worker runs nothing; returns its counters."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = self.worker_stats()
            if stats["in_flight"] == 0 and not any(self.queue_lengths().values()):
                time.sleep(1.2)  # one more heartbeat, so the counters are current
                return self.worker_stats()
            time.sleep(0.2)
        raise AssertionError(f"worker not idle after {timeout_s}s: {self.worker_stats()}")


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """Every sample of a /metrics page, by name and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 if the page has none of that name and labels)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_final(client: httpx.Client, job_id: str, timeout_s: float = 120) -> dict[str, Any]:
    """Long-poll a job until it is final; a job that is not says where it stands."""
    deadline = time.monotonic() + timeout_s
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        response = client.get(f"/v1/jobs/{job_id}", params={"wait": 10})
        assert response.status_code == 200, response.text
        job = response.json()
        if job["status"] in FINAL_STATES:
            return job
    where = {name: job.get(name) for name in ("status", "tier", "model", "attempt", "timings")}
    raise AssertionError(f"job {job_id} not final after {timeout_s}s: {where}")


def read_sse(
    client: httpx.Client,
    job_id: str,
    *,
    last_event_id: int | str | None = None,
    max_events: int | None = None,
    until: Callable[[dict[str, Any]], bool] | None = None,
) -> list[dict[str, Any]]:
    """A job's Server-Sent Events up to the final one, checking each frame.

    Stops early after `max_events`, or at the first event that satisfies `until`.
    """
    headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
    events: list[dict[str, Any]] = []
    frame: dict[str, str] = {}
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith(":"):
                continue  # a heartbeat comment
            if line:
                name, _, value = line.partition(": ")
                frame[name] = value
                continue
            if not frame:
                continue  # the blank line that ends a heartbeat comment
            event = json.loads(frame["data"])
            assert int(frame["id"]) == event["seq"]
            assert frame["event"] == event["type"] and event["job_id"] == job_id
            events.append(event)
            frame = {}
            if event["type"] in FINAL_EVENTS or len(events) == max_events:
                break
            if until is not None and until(event):
                break
    return events


FINAL_EVENTS = ("done", "error", "cancelled", "timed_out")


def streamed_text(events: list[dict[str, Any]]) -> str:
    """The text a reader of these events holds (`core.events.streamed_text`)."""
    return fold_stream(events)[0]


class ExtraWorker:
    """Another worker process beside the stack's own, which a test can kill and start again.

    It runs in its own process group, so a kill takes its engine core with it. It goes by
    `name`, given with `--name`; with `named` False it is started without one, and `name` is
    the one it is expected to choose.
    """

    def __init__(
        self,
        stack: Stack,
        name: str,
        concurrency: int = 8,
        env: dict[str, str] | None = None,
        *,
        named: bool = True,
        args: Sequence[str] = (),
        on_host: Callable[[list[str]], list[str]] | None = None,
    ) -> None:
        self.stack = stack
        self.name = name
        self.named = named
        self.args = list(args)
        self.on_host = on_host  # runs its command elsewhere (`tests.hosts.Host.command`)
        self.concurrency = concurrency
        self.env = env or {}
        self.process: subprocess.Popen[bytes] | None = None
        self.group_killed = False  # by `kill`: its process group's id may be reused since
        self.log = (
            stack.local.settings.data_dir.resolve() / "logs" / f"{name.replace('@', '-')}.log"
        )

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        command = [
            *[sys.executable, "-m", "inferq", "worker", "--device", "cpu"],
            *["--concurrency", str(self.concurrency)],
            *(["--name", self.name] if self.named else []),
            "--metrics-port=0",
            *self.args,
        ]
        self.group_killed = False
        self.process = subprocess.Popen(
            self.on_host(command) if self.on_host else command,
            env={**self.stack.local.env, **self.env},
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while self.name not in live_workers(self.stack.redis):
            assert self.process is not None and self.process.poll() is None, (
                f"worker {self.name} died"
            )
            assert time.monotonic() < deadline, f"worker {self.name} did not start"
            time.sleep(0.5)

    @contextmanager
    def running(self) -> Iterator[Self]:
        """Started and ready for the block; afterwards killed and gone from the live workers.

        Killed, not stopped: a warm shutdown can take a minute (engine teardown), and nothing
        of the worker needs to survive the test.
        """
        self.start()
        try:
            self.wait_ready()
            yield self
        finally:
            if self.process is not None and self.process.poll() is None:
                self.kill()
            elif self.process is not None and not self.group_killed:
                # A worker that died by itself leaves its engine core running in its group.
                with suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
            # A test that killed it keeping its name (`free_name=False`) and failed before the
            # claim lapsed would leave the name taken, and the next test's worker would refuse it.
            self.stack.redis.delete(keys.worker_name_claim(self.name))
            while self.name in live_workers(self.stack.redis):
                time.sleep(0.5)

    def kill(self, *, free_name: bool = True) -> None:
        """SIGKILL the worker and its engine; `free_name` also deletes its name's claim, so a
        restart need not wait for it to lapse (and the scheduler sees the death at once)."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.group_killed = True
        self.process.wait()
        # Its counters would linger until their TTL; drop them so `wait_ready` sees the restart.
        self.stack.redis.delete(keys.worker_stats(self.name))
        if free_name:
            self.stack.redis.delete(keys.worker_name_claim(self.name))

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """The worker and its engine stopped (SIGSTOP) for the block, then continued; a kill
        inside the block ends it frozen.

        The block starts once every process of the group has stopped and what they had sent
        before has landed: SIGSTOP is delivered asynchronously, and a commit already on its way
        to the database becomes visible a moment later (a job read as queued after the freeze
        once turned out to have started on the frozen worker).
        """
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGSTOP)
        _wait_stopped(self.process.pid)
        time.sleep(FREEZE_SETTLE_S)
        try:
            yield
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def command_calls(client: redis.Redis) -> dict[str, int]:
    """How many times a Redis has run each command (its commandstats, scripts' commands too)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


FREEZE_SETTLE_S = 0.5  # for the writes a frozen worker had sent to reach Redis and the database


def _wait_stopped(pgid: int, timeout_s: float = 10) -> None:
    """Until every process of the group is stopped (state T in /proc) or gone."""
    deadline = time.monotonic() + timeout_s
    while running := [pid for pid, state in _group_states(pgid) if state not in "TtZX"]:
        assert time.monotonic() < deadline, f"processes {running} of group {pgid} did not stop"
        time.sleep(0.01)


def _group_states(pgid: int) -> Iterator[tuple[int, str]]:
    """(pid, state) of each process in the process group, read from /proc."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError):
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                yield int(stat.parent.name), fields[0]


@contextmanager
def worker_paused(stack: Stack, name: str | None = None) -> Iterator[None]:
    """A worker (default: the stack's own) takes no new jobs until the block ends.

    Uses Celery's remote control on every queue the worker polls, and adds them back in the
    order it polls them (tier by tier, its own queue before the shared one).
    """
    from core.queue.app import make_celery_app

    worker = name or stack.worker_name
    lane = stack.redis.hget(keys.WORKER_LANES, worker)  # a worker of another model: its queues
    app = make_celery_app(stack.local.settings)
    queues = [
        queue
        for tier in TIERS_BY_PRIORITY
        for queue in (
            keys.worker_queue_name(tier, worker),
            keys.queue_name(tier, lane.decode() if lane else None),
        )
    ]
    try:
        for queue in queues:
            # A worker that has only just become ready may not be subscribed to remote control
            # yet, and misses a broadcast: ask again (cancelling a consumer twice is harmless).
            deadline = time.monotonic() + 30
            while not app.control.cancel_consumer(queue, destination=[worker], reply=True):
                assert time.monotonic() < deadline, f"{worker} did not answer cancel_consumer"
        yield
    finally:
        for queue in queues:
            # A worker the host stalled past the reply's second answers a later ask (adding a
            # queue it already consumes is harmless).
            deadline = time.monotonic() + 30
            while not app.control.add_consumer(queue, destination=[worker], reply=True):
                assert time.monotonic() < deadline, f"{worker} did not answer add_consumer"
        app.close()
