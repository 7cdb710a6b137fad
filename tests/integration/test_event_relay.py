"""Live streams of an API process share one blocking read: each reader gets its job's events
in order, once, from where it started, whoever joins when, and through a lost connection.

A blocking XREAD per reader would hold a Redis connection per reader and cost a command per
event each; these tests count both on a redis-server of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
import redis.exceptions

from api.event_relay import EventRelay, Follow
from core.events import Event, EventPublisher
from inferq.local import free_port
from tests.support import command_calls, redis_server

READERS = 100
STEPS = 20


async def _read_to_end(follow: Follow, timeout_s: float = 30) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout_s):
        while not events or events[-1]["type"] != "done":
            events += await follow.next(timeout_s)
    return events


def _relay(url: str, max_block_ms: int = 2000, patience_s: float = 30) -> EventRelay:
    return EventRelay(
        aioredis.Redis.from_url(url, socket_timeout=max_block_ms / 1000 + 10),
        aioredis.Redis.from_url(url),
        patience_s=patience_s,
        max_block_ms=max_block_ms,
    )


def test_many_readers_share_one_connection_and_a_read_per_step(tmp_path: Path) -> None:
    """A hundred readers of a hundred jobs, whose worker publishes a step's deltas of every job
    in one call: each reader gets every event of its job in order, and Redis sees one more
    connection and about one XREAD per step, not one per reader and event."""
    with redis_server(tmp_path) as server:
        sync = redis.Redis.from_url(server.url)
        publisher = EventPublisher(sync, ttl_s=60)
        jobs = [f"job_{i}" for i in range(READERS)]

        async def scenario() -> None:
            relay = _relay(server.url)
            clients_before = len(sync.client_list())
            xreads_before = command_calls(sync).get("xread", 0)
            async with contextlib.AsyncExitStack() as stack:
                follows = [await stack.enter_async_context(relay.follow(j, 0)) for j in jobs]
                readers = [asyncio.create_task(_read_to_end(f)) for f in follows]
                await asyncio.sleep(0.2)
                assert len(sync.client_list()) - clients_before <= 2  # the relay's and the pool's
                for step in range(STEPS):
                    step_events: list[Event] = [
                        (job, "delta", {"attempt": 1, "text": f"{step} ", "tokens": 1, "at": 0.0})
                        for job in jobs
                    ]
                    await asyncio.to_thread(publisher.publish_many, step_events)
                    await asyncio.sleep(0.02)
                await asyncio.to_thread(
                    publisher.publish_many, [(job, "done", {"status": "succeeded"}) for job in jobs]
                )
                streams = await asyncio.gather(*readers)
            xreads = command_calls(sync).get("xread", 0) - xreads_before
            for events in streams:
                assert [event["seq"] for event in events] == list(range(1, STEPS + 2))
                assert "".join(e["text"] for e in events[:-1]) == "".join(
                    f"{step} " for step in range(STEPS)
                )
            assert xreads <= 4 * STEPS, xreads  # a reader's XREAD per event would be 2,100
            assert relay.readers() == 0
            await relay.close()

        asyncio.run(scenario())


def test_a_reader_joining_during_a_blocked_read_is_served_without_waiting_it_out(
    tmp_path: Path,
) -> None:
    """The relay blocks for a job with no news; a reader of another job, and a second reader of
    the same job from an earlier place, get their events long before that read would end."""
    with redis_server(tmp_path) as server:
        sync = redis.Redis.from_url(server.url)
        publisher = EventPublisher(sync, ttl_s=60)
        for text in ("a", "b", "c"):
            publisher.publish("job_quiet", "delta", attempt=1, text=text, tokens=1, at=0.0)
        publisher.publish("job_ready", "done", status="succeeded")

        async def scenario() -> None:
            relay = _relay(server.url, max_block_ms=60_000)
            async with relay.follow("job_quiet", 3) as quiet:
                waiting = asyncio.create_task(quiet.next(60))
                await asyncio.sleep(0.3)  # the relay now blocks on job_quiet after event 3
                async with relay.follow("job_ready", 0) as ready:
                    events = await asyncio.wait_for(_read_to_end(ready), 10)
                assert [event["type"] for event in events] == ["done"]
                async with relay.follow("job_quiet", 1) as late:
                    assert [e["text"] for e in await asyncio.wait_for(late.next(60), 10)] == [
                        "b",
                        "c",
                    ]
                publisher.publish("job_quiet", "delta", attempt=1, text="d", tokens=1, at=0.0)
                assert [e["seq"] for e in await asyncio.wait_for(waiting, 10)] == [4]
            await relay.close()

        asyncio.run(scenario())


def test_a_lost_connection_loses_and_repeats_nothing_and_a_lost_redis_ends_the_wait(
    tmp_path: Path,
) -> None:
    with redis_server(tmp_path) as server:
        sync = redis.Redis.from_url(server.url)
        publisher = EventPublisher(sync, ttl_s=60)

        async def scenario() -> None:
            relay = _relay(server.url)
            async with relay.follow("job_cut", 0) as follow:
                reader = asyncio.create_task(_read_to_end(follow))
                for i in range(10):
                    publisher.publish("job_cut", "delta", attempt=1, text=str(i), tokens=1, at=0.0)
                    if i == 4:
                        assert sync.client_kill_filter(_type="normal", skipme=True) > 0
                    await asyncio.sleep(0.05)
                publisher.publish("job_cut", "done", status="succeeded")
                events = await reader
            assert [event["seq"] for event in events] == list(range(1, 12))
            await relay.close()

            nowhere = _relay(f"redis://127.0.0.1:{free_port()}/0", patience_s=0.5)
            async with nowhere.follow("job_lost", 0) as follow:
                with pytest.raises(redis.exceptions.ConnectionError):
                    await asyncio.wait_for(follow.next(60), 30)
            await nowhere.close()

        asyncio.run(scenario())
