"""The integration stack: real Redis, SQLite and PostgreSQL, a Celery worker, the vLLM engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from core.db import Database
from core.jobs import JobStore
from migrations import upgrade
from tests.otlp import OtlpReceiver
from tests.stacks import running_stack
from tests.support import RedisServer, Stack, postgres_database, redis_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def redis_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis server owned by this test session, on a free port."""
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
    """API, worker and scheduler processes on this session's Redis and the current database."""
    tmp = tmp_path_factory.mktemp("stack")
    with running_stack(tmp, redis_url, database_url, model_dir, otlp.url) as stack:
        yield stack


@pytest.fixture(autouse=True)
def _admission_as_on_a_fresh_stack(request: pytest.FixtureRequest) -> None:
    """Each test on the shared stack is judged by admission control as on a fresh system.

    The start and end rates admission control measures are the demand of earlier tests, not what
    the worker can take: a test's batch would otherwise be refused for what ran before it.
    """
    if "stack" in request.fixturenames:
        stack: Stack = request.getfixturevalue("stack")
        stack.forget_measured_load()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[JobStore]:
    """A job store on a fresh, migrated database."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'inferq.db'}"
        upgrade(url)
        yield JobStore(Database(url))
        return
    with postgres_database() as url:
        upgrade(url)
        database = Database(url)
        yield JobStore(database)
        database.engine.dispose()
