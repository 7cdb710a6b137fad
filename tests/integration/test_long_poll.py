"""Waits for a job's end (long polls, `Prefer: wait`, cancellations) share one subscription per
API process, wake at the job's final event and not at its deltas, and survive a Redis restart.

A generating job publishes a delta event up to twenty times a second; hundreds of long polls
woken by each of them would take the API's CPU from everything else, and a blocking read per
wait would take a Redis connection each.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis
import redis.asyncio as aioredis

from api.final_events import FinalEvents
from core.events import EventPublisher
from tests.support import redis_server

WAITS = 200


def _calls(client: redis.Redis, command: str) -> int:
    stats = client.info("commandstats").get(f"cmdstat_{command}", {})
    return int(stats.get("calls", 0))


def test_a_wait_wakes_at_the_final_event_and_not_at_deltas(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        sync = redis.Redis.from_url(server.url)
        publisher = EventPublisher(sync, ttl_s=60)

        async def scenario() -> None:
            client = aioredis.Redis.from_url(server.url)
            finals = FinalEvents(client)
            waiter = asyncio.create_task(finals.wait(["job_poll"], 30))
            await asyncio.sleep(0.2)
            for _ in range(40):
                publisher.publish("job_poll", "delta", attempt=1, text="x", tokens=1, at=0.0)
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)
            assert not waiter.done()
            publisher.publish("job_poll", "done", status="succeeded")
            assert await asyncio.wait_for(waiter, 10) is True
            assert finals.pending() == 0
            # A wait that begins after the final event returns at once; one without, times out.
            assert await asyncio.wait_for(finals.wait(["job_poll"], 30), 5)
            assert await finals.wait(["job_never"], 0.3) is False
            # Several jobs: true only once every one has ended.
            assert await finals.wait(["job_poll", "job_never"], 0.3) is False
            assert finals.pending() == 0
            await finals.close()
            await client.aclose()

        asyncio.run(scenario())


def test_waits_that_begin_together_share_one_connection_and_one_check(tmp_path: Path) -> None:
    """Two hundred concurrent waits: no connection of their own, one read to see whether their
    jobs ended already, and each wakes at its own job's final event."""
    with redis_server(tmp_path) as server:
        sync = redis.Redis.from_url(server.url)
        publisher = EventPublisher(sync, ttl_s=60)
        publisher.publish("job_0", "done", status="succeeded")  # ended before its wait

        async def scenario() -> None:
            client = aioredis.Redis.from_url(server.url)
            finals = FinalEvents(client)
            clients_before = int(sync.info("clients")["connected_clients"])
            checks_before = _calls(sync, "xrevrange")
            waits = [asyncio.create_task(finals.wait([f"job_{i}"], 30)) for i in range(WAITS)]
            await asyncio.sleep(0.5)
            assert waits[0].done() and waits[0].result() is True
            assert not any(wait.done() for wait in waits[1:])
            # The subscription and the check's connection, not one per wait.
            assert int(sync.info("clients")["connected_clients"]) - clients_before <= 3
            # One pipelined check for all of them (two if the subscription's sweep came
            # between), not one per wait.
            assert _calls(sync, "xrevrange") - checks_before <= 2 * WAITS
            publisher.publish_many([(f"job_{i}", "done", {}) for i in range(1, WAITS, 2)])
            await asyncio.sleep(0.5)
            assert [wait.done() for wait in waits[1:]] == [i % 2 == 1 for i in range(1, WAITS)]
            publisher.publish_many([(f"job_{i}", "done", {}) for i in range(2, WAITS, 2)])
            assert all(await asyncio.wait_for(asyncio.gather(*waits), 10))
            await finals.close()
            await client.aclose()

        asyncio.run(scenario())
        assert _calls(sync, "xread") == 0


def test_a_wait_survives_a_redis_restart(tmp_path: Path) -> None:
    """A final event published while the subscription was down still ends the wait."""
    with redis_server(tmp_path) as server:

        async def scenario() -> None:
            client = aioredis.Redis.from_url(server.url)
            finals = FinalEvents(client, sweep_s=0.5)
            waiter = asyncio.create_task(finals.wait(["job_restart"], 60))
            await asyncio.sleep(0.3)
            server.stop()
            await asyncio.sleep(0.5)
            server.start()
            # Published before the subscription is back: a sweep finds it.
            EventPublisher(redis.Redis.from_url(server.url), ttl_s=60).publish(
                "job_restart", "done", status="succeeded"
            )
            assert await asyncio.wait_for(waiter, 20) is True
            await finals.close()
            await client.aclose()

        asyncio.run(scenario())


def test_a_watch_registered_before_the_read_needs_no_check_while_its_subscription_stands(
    tmp_path: Path,
) -> None:
    """A long poll registers its wait before it reads the job: an end the read did not see is
    published after, on the subscription Redis confirmed before, so nothing reads the job's
    stream. Registered before any confirmation, the wait reads the stream; with the
    subscription lost after the registration, an end published unheard still ends the wait
    (the waits are checked when Redis confirms the subscription again)."""
    with redis_server(tmp_path) as server:
        sync = redis.Redis.from_url(server.url)
        publisher = EventPublisher(sync, ttl_s=60)
        publisher.publish("job_early", "done", status="succeeded")  # before any subscription

        async def scenario() -> None:
            client = aioredis.Redis.from_url(server.url)
            finals = FinalEvents(client, sweep_s=60)
            checks = _calls(sync, "xrevrange")
            with finals.watch(["job_early"]) as watch:  # nothing confirmed yet
                assert await asyncio.wait_for(watch.wait(30), 10) is True
            assert _calls(sync, "xrevrange") > checks
            for _ in range(1000):
                if finals.listening:
                    break
                await asyncio.sleep(0.01)
            assert finals.listening

            checks = _calls(sync, "xrevrange")
            with finals.watch(["job_later"]) as watch:
                # (the job's state is read here: it has not ended)
                publisher.publish("job_later", "done", status="succeeded")
                assert await asyncio.wait_for(watch.wait(30), 10) is True
            with finals.watch(["job_never"]) as watch:
                assert await watch.wait(0.3) is False
            assert _calls(sync, "xrevrange") == checks
            assert finals.pending() == 0

            with finals.watch(["job_unheard"]) as watch:
                sync.client_kill_filter(_type="pubsub")
                publisher.publish("job_unheard", "done", status="succeeded")
                assert await asyncio.wait_for(watch.wait(30), 10) is True
            assert _calls(sync, "xrevrange") > checks
            await finals.close()
            await client.aclose()

        asyncio.run(scenario())
