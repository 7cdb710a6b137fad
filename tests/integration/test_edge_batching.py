"""Edge batching: a worker with free slots takes the waiting jobs in bulk, and loses none."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import redis
from kombu import Connection, Exchange, Queue
from kombu.asynchronous import Hub
from prometheus_client.parser import text_string_to_metric_families

from core.tiers import Tier
from tests.support import Stack, redis_server, wait_final, worker_paused
from workers.edge import EdgeBatchingTransport

JOBS = 24


def _taken_in_bulk(stack: Stack) -> float:
    text = httpx.get(stack.worker_metrics_url, timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "inferq_jobs_taken_in_bulk_total":
                return sample.value
    return 0.0


def test_an_idle_worker_takes_the_waiting_jobs_in_bulk(stack: Stack) -> None:
    key = stack.create_key(Tier.PREMIUM)  # premium may fill every slot (basic: its share)
    stack.wait_idle()
    before = _taken_in_bulk(stack)
    body = {"jobs": [{"prompt": f"Bulk {i}.", "max_tokens": 4} for i in range(JOBS)]}
    with stack.client(key) as client:
        with worker_paused(stack):
            response = client.post("/v1/jobs/batch", json=body)
            assert response.status_code == 202, response.text
            jobs = response.json()["data"]
            deadline = time.monotonic() + 30
            while stack.queue_lengths()[Tier.PREMIUM.value] < JOBS:
                assert time.monotonic() < deadline, stack.queue_lengths()
                time.sleep(0.1)
        # One BRPOP brings the first; one bulk take brings the rest (the worker has 32 slots).
        done = [wait_final(client, job["id"], timeout_s=120) for job in jobs]
    assert [job["status"] for job in done] == ["succeeded"] * JOBS
    assert all(job["attempt"] == 1 for job in done), [job["attempt"] for job in done]
    assert _taken_in_bulk(stack) - before == JOBS - 1
    # Every message taken in bulk was acknowledged: nothing is left for the visibility timeout
    # to redeliver (the transport keeps unacknowledged messages in the `unacked` hash).
    deadline = time.monotonic() + 10
    while stack.redis.hlen("unacked"):
        assert time.monotonic() < deadline, stack.redis.hkeys("unacked")
        time.sleep(0.2)


def test_the_channel_keeps_one_client_for_its_short_commands(tmp_path: Path) -> None:
    """Recording, acking and events reuse one client; a replaced pool gets a new one."""
    with (
        redis_server(tmp_path) as server,
        Connection(server.url, transport=EdgeBatchingTransport) as connection,
    ):
        channel = connection.default_channel
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second
            assert first.ping()
        channel._pool = None  # what kombu does to the pools when the connection is lost
        with channel.conn_or_acquire() as third:
            assert third is not first
            assert third.connection_pool is channel.pool
            assert third.ping()


def _calls(client: redis.Redis, command: str) -> int:
    stats: dict[str, dict[str, int]] = client.info("commandstats")
    return stats.get(f"cmdstat_{command}", {}).get("calls", 0)


def test_acks_made_in_one_turn_of_the_event_loop_go_to_redis_together(tmp_path: Path) -> None:
    """Twenty acks in one turn: twenty free slots at once, one ZREM at the turn's end; the
    acks still pending when the channel closes are sent then; a lost Redis loses no ack."""
    queue = Queue("acks", Exchange("acks"), routing_key="acks")
    with (
        redis_server(tmp_path) as server,
        Connection(server.url, transport=EdgeBatchingTransport) as connection,
    ):
        client = redis.Redis.from_url(server.url)
        hub = Hub()
        connection.transport.register_with_event_loop(connection.connection, hub)
        channel = connection.default_channel
        channel.basic_qos(0, 20, False)
        producer = connection.Producer(channel)
        for i in range(25):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="acks", declare=[queue])
        messages = [channel.basic_get("acks", no_ack=False) for _ in range(20)]
        assert client.hlen("unacked") == 20
        assert not channel.qos.can_consume()  # the prefetch limit of 20 is reached
        zrem_before = _calls(client, "zrem")

        for message in messages:
            message.ack()
        assert channel.qos.can_consume()  # every slot is free at once...
        assert client.hlen("unacked") == 20  # ...and Redis hears at the end of the turn
        for on_tick in list(hub.on_tick):
            on_tick()
        assert client.hlen("unacked") == 0
        assert client.zcard("unacked_index") == 0
        assert _calls(client, "zrem") - zrem_before == 1

        last = [channel.basic_get("acks", no_ack=False) for _ in range(5)]
        for message in last[:3]:
            message.ack()
        channel.close()  # before the turn ends: the acks go out, the other two are restored
        assert client.hlen("unacked") == 0
        assert client.llen("acks") == 2
        last[3].ack()  # a job that ends after its channel closed (Redis was lost meanwhile)

        channel = connection.channel()
        message = channel.basic_get("acks", no_ack=False)
        server.stop()
        message.ack()
        connection.transport.flush_acks()  # logs the lost ack; the visibility restore has it
        server.start()
