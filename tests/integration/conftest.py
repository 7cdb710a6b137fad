"""The integration stack: real Redis, SQLite and PostgreSQL, a Celery worker, the vLLM engine."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferq.local import free_port
from tests.otlp import OtlpReceiver
from tests.support import (
    WORKER_CONCURRENCY,
    RedisServer,
    Stack,
    postgres_database,
    redis_server,
    start_stack,
    wait_ready,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def redis_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis server owned by this test session (the fault tests restart it)."""
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_service: RedisServer) -> str:
    """Where this test session's Redis answers."""
    return redis_service.url


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def database_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Each integration test runs once on SQLite and once on PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'inferq.db'}"
    else:
        with postgres_database() as url:
            yield url


@pytest.fixture(scope="session")
def otlp() -> Iterator[OtlpReceiver]:
    """Where the stack's processes export their traces."""
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="session")
def stack(
    redis_url: str,
    database_url: str,
    model_dir: Path,
    otlp: OtlpReceiver,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """API and worker processes on this session's Redis and the current database."""
    import redis as redis_lib

    redis_lib.Redis.from_url(redis_url).flushdb()
    tmp = tmp_path_factory.mktemp("stack")
    local = start_stack(tmp, redis_url, database_url, model_dir, otlp.url)
    port, metrics_port = free_port(), free_port()
    local.start(
        "worker",
        [
            sys.executable,
            "-m",
            "inferq",
            "worker",
            "--device",
            "cpu",
            "--concurrency",
            str(WORKER_CONCURRENCY),
            "--metrics-port",
            str(metrics_port),
        ],
    )
    local.start("api", [sys.executable, "-m", "inferq", "api", "--port", str(port)])
    local.start("scheduler", [sys.executable, "-m", "inferq", "scheduler"])
    running = Stack(
        api_url=f"http://127.0.0.1:{port}",
        redis_url=redis_url,
        database_url=database_url,
        model_dir=model_dir,
        local=local,
        worker_metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
    )
    try:
        wait_ready(running)
        yield running
    finally:
        local.stop()
        for name in ("worker", "api", "scheduler"):
            log = tmp / "logs" / f"{name}.log"
            if log.exists():
                tail = log.read_text(errors="replace").splitlines()[-15:]
                sys.stderr.write(f"\n--- {name}.log (tail) ---\n" + "\n".join(tail) + "\n")
