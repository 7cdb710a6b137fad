"""Redis behind Sentinel: the primary is killed while jobs run and streams are read, a replica
takes over, and inferq follows it with nothing lost.

The stack is given a Sentinel URL (`core.redisconn`), so its API, scheduler and worker (broker,
pub/sub, streams, quotas) all find the primary through the Sentinels. The primary is killed
with SIGKILL: what it had not yet sent its replica is gone, as in a real failover.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.tiers import Tier
from tests.integration.test_outages import (
    LONG_TOKENS,
    _assert_each_ended_once,
    _submit_after_outage,
    _submit_many,
    _wait_running,
)
from tests.otlp import OtlpReceiver
from tests.sentinels import Sentinels, sentinel_redis
from tests.stacks import running_stack
from tests.support import FINAL_EVENTS, Stack, postgres_database, read_sse, streamed_text

READERS = 4


@pytest.fixture
def sentinel_stack(
    tmp_path: Path, model_dir: Path, otlp: OtlpReceiver
) -> Iterator[tuple[Stack, Sentinels]]:
    """A stack on a Sentinel-watched Redis of its own and a PostgreSQL database of its own."""
    binary = shutil.which("redis-server")
    assert binary, "the Sentinel test runs redis-server (and its --sentinel mode)"
    (tmp_path / "redis").mkdir()
    (tmp_path / "stack").mkdir()
    with (
        sentinel_redis(binary, tmp_path / "redis") as servers,
        postgres_database() as database_url,
        running_stack(tmp_path / "stack", servers.url, database_url, model_dir, otlp.url) as stack,
    ):
        yield stack, servers


def _follow(stack: Stack, key: str, job_id: str) -> list[dict[str, Any]]:
    """A reader of the job's stream to its end, resuming by Last-Event-ID whenever it is cut."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + 300
    with stack.client(key) as client:
        while not events or events[-1]["type"] not in FINAL_EVENTS:
            assert time.monotonic() < deadline, f"{job_id}'s stream did not end"
            try:
                events += read_sse(
                    client, job_id, last_event_id=events[-1]["seq"] if events else None
                )
            except (httpx.HTTPError, AssertionError):  # cut, or 503 while Redis fails over
                time.sleep(0.5)
    return events


@pytest.mark.timeout(900)
def test_a_redis_failover_loses_no_job_and_streams_resume(
    sentinel_stack: tuple[Stack, Sentinels],
) -> None:
    stack, servers = sentinel_stack
    key = stack.create_key(Tier.STANDARD)
    with stack.client(key) as client, ThreadPoolExecutor(READERS) as pool:
        before = stack.worker_stats()["engine_requests"]
        followed = _submit_many(stack, key, "Followed", READERS, tokens=LONG_TOKENS)
        readers = [pool.submit(_follow, stack, key, job["id"]) for job in followed]
        accepted = followed + _submit_many(stack, key, "Before the failover", 44)
        _wait_running(stack, before)

        old = servers.primary()
        servers.kill(old)
        killed_at = time.monotonic()
        while servers.primary() == old:
            assert time.monotonic() < killed_at + 60, "the Sentinels did not fail over"
            time.sleep(0.1)
        failover_s = time.monotonic() - killed_at
        accepted += [
            _submit_after_outage(stack, client, f"After the failover, {i}.") for i in range(4)
        ]
        _assert_each_ended_once(stack, client, accepted)
        streams = [reader.result(timeout=300) for reader in readers]
        stored = [client.get(f"/v1/jobs/{job['id']}").json()["text"] for job in followed]
    print(f"\nthe Sentinels named a new primary {failover_s:.1f} s after the kill")
    # Every reader, resuming by Last-Event-ID across the failover, got the job's whole text:
    # the deltas the worker could not publish while Redis failed over went out once it was
    # back (workers.streams). Only deltas the old primary took and died before sending its
    # replica (a millisecond's worth on loopback) could be missing.
    for events, text in zip(streams, stored, strict=True):
        assert events[-1]["type"] == "done"
        assert streamed_text(events) == text
