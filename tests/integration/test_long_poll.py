"""Long polls (`GET /v1/jobs/{id}?wait=N`) wake at a job's final event, not at its deltas.

A generating job publishes a delta event up to twenty times a second; hundreds of long polls
woken by each of them would take the API's CPU from everything else.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis
import redis.asyncio as aioredis

from core.events import EventPublisher, wait_for_final_event
from tests.support import redis_server


def _xread_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats").get("cmdstat_xread", {})
    return int(stats.get("calls", 0))


def test_a_long_poll_wakes_at_the_final_event_and_not_at_deltas(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        sync = redis.Redis.from_url(server.url)
        publisher = EventPublisher(sync, ttl_s=60)

        async def scenario() -> None:
            client = aioredis.Redis.from_url(server.url)
            before = _xread_calls(sync)
            waiter = asyncio.create_task(wait_for_final_event(client, "job_poll", 30))
            await asyncio.sleep(0.2)
            for _ in range(40):
                publisher.publish("job_poll", "delta", attempt=1, text="x", tokens=1, at=0.0)
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)
            assert not waiter.done()
            # One blocking read so far (two if a block ran out meanwhile): no delta woke it.
            assert _xread_calls(sync) - before <= 2
            publisher.publish("job_poll", "done", status="succeeded")
            assert await asyncio.wait_for(waiter, 10) is True
            # A poll that starts after the final event returns at once; one without, times out.
            assert await asyncio.wait_for(wait_for_final_event(client, "job_poll", 30), 5)
            assert await wait_for_final_event(client, "job_never", 0.3) is False
            await client.aclose()

        asyncio.run(scenario())
        assert sync.ttl("inferq:job:job_poll:final") > 0


def test_a_long_poll_blocks_as_long_as_the_clients_socket_timeout_allows(tmp_path: Path) -> None:
    """Each blocking read is a round trip and a wake-up of the API: the fewer, the better."""
    with redis_server(tmp_path) as server:
        sync = redis.Redis.from_url(server.url)

        async def scenario() -> None:
            # The API's own client has a 10 s socket timeout.
            client = aioredis.Redis.from_url(server.url, socket_timeout=10)
            before = _xread_calls(sync)
            assert await wait_for_final_event(client, "job_never", 5) is False
            # One read of 5 s: two-second reads took three.
            assert _xread_calls(sync) - before == 1
            await client.aclose()

        asyncio.run(scenario())
