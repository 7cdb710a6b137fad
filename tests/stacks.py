"""Starting and stopping a whole inferq for the integration tests: worker, API and scheduler."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from core.redisconn import sync_client
from core.settings import Settings
from inferq.local import LocalStack, free_port
from migrations import upgrade
from tests.support import (
    BLOCKER_TOKENS,
    EXPERIMENT,
    FLOWER_AUTH,
    LEASE_TTL_S,
    WORKER_CONCURRENCY,
    ServiceMissing,
    Stack,
    redis_server,
)

TINY_CONTEXT = 16384
"""The tiny model's context length: room for the long prompts of the merging and routing tests."""


@contextmanager
def running_stack(
    tmp: Path,
    redis_url: str,
    database_url: str,
    model_dir: Path,
    otlp_endpoint: str,
    max_model_len: int | None = TINY_CONTEXT,
    env: dict[str, str] | None = None,
) -> Iterator[Stack]:
    """A worker, the API and the scheduler on `redis_url` (emptied first) and `database_url`.

    `max_model_len` None: the model's own; `env`: more settings for all three. On the way out
    it stops them and prints the tail of each one's log, for the test report.
    """
    sync_client(redis_url).flushdb()
    local = start_stack(tmp, redis_url, database_url, model_dir, otlp_endpoint, max_model_len)
    local.env.update(env or {})
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
    stack = Stack(
        api_url=f"http://127.0.0.1:{port}",
        redis_url=redis_url,
        database_url=database_url,
        model_dir=model_dir,
        local=local,
        worker_metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
    )
    try:
        wait_ready(stack)
        yield stack
    finally:
        local.stop()
        for name in ("worker", "api", "scheduler"):
            log = tmp / "logs" / f"{name}.log"
            if log.exists():
                tail = log.read_text(errors="replace").splitlines()[-15:]
                sys.stderr.write(f"\n--- {name}.log (tail) ---\n" + "\n".join(tail) + "\n")


@contextmanager
def stack_of_its_own(
    tmp: Path,
    model_dir: Path,
    otlp_endpoint: str,
    *,
    env: dict[str, str] | None = None,
    max_model_len: int | None = TINY_CONTEXT,
) -> Iterator[Stack]:
    """`running_stack` on a Redis server and a SQLite database of its own, under `tmp`: for a
    module whose settings (`env`) differ from the session's stack."""
    (tmp / "stack").mkdir()
    with (
        redis_server(tmp) as server,
        running_stack(
            tmp / "stack",
            server.url,
            f"sqlite:///{tmp / 'inferq.db'}",
            model_dir,
            otlp_endpoint,
            max_model_len,
            env,
        ) as stack,
    ):
        yield stack


STACK_TIERS: dict[str, dict[str, object]] = {
    "premium": {"max_tokens": BLOCKER_TOKENS, "timeout_s": 300}
}
"""The test stacks' tier table (INFERQ_TIERS): long premium jobs keep the worker busy while a
test builds a backlog behind them, and outlive the slowest moments of a shared 2-core machine."""


def start_stack(
    tmp: Path,
    redis_url: str,
    database_url: str,
    model_dir: Path,
    otlp_endpoint: str,
    max_model_len: int | None = TINY_CONTEXT,
) -> LocalStack:
    """Migrate the database, then start one worker and the API as child processes."""
    upgrade(database_url)
    settings = Settings(data_dir=tmp, redis_url=redis_url, database_url=database_url)
    local = LocalStack(settings)
    local.env.update(
        INFERQ_DATA_DIR=str(tmp),
        INFERQ_REDIS_URL=redis_url,
        INFERQ_DATABASE_URL=database_url,
        INFERQ_MODEL=str(model_dir),
        INFERQ_TIERS=json.dumps(STACK_TIERS),
        INFERQ_EXPERIMENTS=json.dumps({"greeting": EXPERIMENT}),
        INFERQ_LOG_LEVEL="INFO",
        # Leases shorter than the default (see LEASE_TTL_S).
        INFERQ_LEASE_TTL_S=str(LEASE_TTL_S),
        INFERQ_SCHEDULER_INTERVAL_S="0.5",
        INFERQ_SCHEDULER_METRICS_PORT=str(free_port()),
        INFERQ_FLOWER_BASIC_AUTH=FLOWER_AUTH,
        INFERQ_OTLP_ENDPOINT=otlp_endpoint,
        OTEL_BSP_SCHEDULE_DELAY="200",
    )
    if max_model_len is not None:
        local.env["INFERQ_MAX_MODEL_LEN"] = str(max_model_len)
    return local


def wait_ready(stack: Stack, timeout_s: float = 300) -> None:
    """Wait until the API is ready and the worker's heartbeat is up."""
    if not stack.local.wait_http(f"{stack.api_url}/readyz", timeout_s=60):
        raise ServiceMissing("the API did not become ready")
    if not stack.local.wait_worker(stack.redis_url, timeout_s):
        raise ServiceMissing("the worker did not start")
