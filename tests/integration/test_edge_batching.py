"""Edge batching: a worker with free slots takes the waiting jobs in bulk, and loses none."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from kombu import Connection, Exchange, Queue
from kombu.asynchronous import Hub
from prometheus_client.parser import text_string_to_metric_families

from core import keys
from core.queue.wake import push_wakes
from core.tiers import Tier
from tests.support import Stack, command_calls, redis_server, wait_final, worker_paused
from workers.edge import EdgeBatchingTransport
from workers.take import take_command

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


def _waiting_channel(connection: Connection, queue: Queue, got: list[Any]) -> Any:
    channel = connection.default_channel
    channel.basic_qos(0, 8, False)
    queue(channel).declare()
    channel.basic_consume(queue.name, no_ack=False, callback=got.append, consumer_tag="t")
    return channel


def test_a_take_whose_reply_is_lost_leaves_its_messages_recorded_as_taken(tmp_path: Path) -> None:
    """Every message leaves its queue by the take script, which records it as unacknowledged in
    the same step: a connection lost before the reply leaves it to the handoff, not nowhere."""
    queue = Queue("lost", Exchange("lost"), routing_key="lost")
    with (
        redis_server(tmp_path) as server,
        Connection(server.url, transport=EdgeBatchingTransport) as connection,
    ):
        client = redis.Redis.from_url(server.url)
        channel = _waiting_channel(connection, queue, [])
        producer = connection.Producer(channel)
        for i in range(3):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="lost")
        connection.transport.cycle.on_poll_start()  # sends a take: the channel has room
        deadline = time.monotonic() + 10
        while client.llen("lost"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        channel.client.connection.disconnect()  # the reply is lost on the wire
        assert client.hlen("unacked") == 3
        assert client.zcard("unacked_index") == 3


def test_a_waiting_channel_wakes_on_a_published_job_long_before_its_wait_ends(
    tmp_path: Path,
) -> None:
    """A channel with nothing to take waits on wake-up lists; a job published the way the API
    publishes (message, then a token) wakes it at once, and the take clears the token."""
    queue = Queue("inferq.premium", Exchange("inferq.premium"), routing_key="inferq.premium")
    with (
        redis_server(tmp_path) as server,
        Connection(
            server.url, transport=EdgeBatchingTransport, transport_options={"polling_interval": 60}
        ) as connection,
    ):
        client = redis.Redis.from_url(server.url)
        got: list[Any] = []
        channel = _waiting_channel(connection, queue, got)
        assert channel.brpop_timeout == 60
        with pytest.raises(TimeoutError):  # an empty take, then a wait
            connection.drain_events(timeout=1)
        assert channel._sent == "BLPOP"
        pipe = client.pipeline(transaction=False)
        message = channel.prepare_message('{"job": 1}', properties={"delivery_tag": "tag-1"})
        message["properties"]["delivery_info"] = {"exchange": "", "routing_key": queue.name}
        pipe.lpush(queue.name, json.dumps(message))
        push_wakes(pipe, {queue.name: 1})
        pipe.execute()
        started = time.monotonic()
        while not got:
            connection.drain_events(timeout=10)
        assert time.monotonic() - started < 10  # the wait was for 60 s
        assert client.hlen("unacked") == 1
        assert not client.exists(keys.queue_wake(queue.name))


def test_a_take_keeps_the_wake_up_lists_of_the_queues_it_leaves_messages_in(
    tmp_path: Path,
) -> None:
    """The take clears a queue's tokens once it finds the queue empty, never before: a queue
    that still holds messages keeps waking workers."""
    premium, basic = "inferq.premium", "inferq.basic"
    with redis_server(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        pipe = client.pipeline(transaction=False)
        for queue, count in ((premium, 3), (basic, 40)):
            for i in range(count):
                envelope = {"properties": {"delivery_tag": f"{queue}-{i}", "delivery_info": {}}}
                pipe.lpush(queue, json.dumps(envelope))
        push_wakes(pipe, {premium: 3, basic: 40})
        pipe.execute()
        assert client.llen(keys.queue_wake(basic)) == 16  # at most WAKE_TOKENS

        lists = [(premium, premium), (basic, basic)]
        taken = client.execute_command(*take_command(lists, ("unacked", "unacked_index"), 10, {}))
        assert [queue.decode() for queue in taken[::2]] == [premium] * 3 + [basic] * 7
        assert client.hlen("unacked") == 10
        assert not client.exists(keys.queue_wake(premium))
        assert client.llen(keys.queue_wake(basic)) == 16

        taken = client.execute_command(*take_command(lists, ("unacked", "unacked_index"), 99, {}))
        assert len(taken) == 2 * 33
        assert not client.exists(keys.queue_wake(basic))
        assert (
            client.execute_command(*take_command(lists, ("unacked", "unacked_index"), 9, {})) == []
        )


def test_a_take_pops_each_queue_oldest_first_within_the_tiers_rooms_in_a_few_commands(
    tmp_path: Path,
) -> None:
    """One RPOP per queue, one HSET and one ZADD for the whole take: taking 32 messages once
    cost Redis three commands a message. A lower tier's room counts what the tiers above took."""
    queues = {Tier.PREMIUM: 3, Tier.STANDARD: 5, Tier.BASIC: 40}
    with redis_server(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        pipe = client.pipeline(transaction=False)
        for tier, count in queues.items():
            for i in range(count):
                info = {"exchange": "", "routing_key": keys.queue_name(tier)}
                envelope = {"properties": {"delivery_tag": f"{tier}-{i}", "delivery_info": info}}
                pipe.lpush(keys.queue_name(tier), json.dumps(envelope))
        pipe.execute()
        lists = [(keys.queue_name(tier), keys.queue_name(tier)) for tier in queues]
        rooms = {Tier.PREMIUM: 32, Tier.STANDARD: 6, Tier.BASIC: 7}
        before = command_calls(client)
        taken = client.execute_command(
            *take_command(lists, ("unacked", "unacked_index"), 32, rooms)
        )
        calls = {name: n - before.get(name, 0) for name, n in command_calls(client).items()}
        tags = [json.loads(item)["properties"]["delivery_tag"] for item in taken[1::2]]
        premium, standard = ["premium-0", "premium-1", "premium-2"], ["standard-0", "standard-1"]
        assert tags == [*premium, *standard, "standard-2", "basic-0"]
        assert sorted(k.decode() for k in client.hkeys("unacked")) == sorted(tags)
        message, exchange, routing_key = json.loads(client.hget("unacked", "basic-0") or "")
        assert (exchange, routing_key) == ("", keys.queue_name(Tier.BASIC))
        assert message["properties"]["delivery_tag"] == "basic-0"
        assert client.zcard("unacked_index") == len(tags)
        assert (calls["rpop"], calls["hset"], calls["zadd"]) == (3, 1, 1)


def test_a_take_read_after_an_error_event_delivers_its_messages(tmp_path: Path) -> None:
    """kombu reads the pending reply of a socket that reports an error as a BRPOP's and drops
    it; the channel reads it as the take it sent, so the messages reach the worker."""
    queue = Queue("errored", Exchange("errored"), routing_key="errored")
    with (
        redis_server(tmp_path) as server,
        Connection(server.url, transport=EdgeBatchingTransport) as connection,
    ):
        got: list[Any] = []
        channel = _waiting_channel(connection, queue, got)
        producer = connection.Producer(channel)
        for i in range(3):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="errored")
        connection.transport.cycle.on_poll_start()  # sends a take
        channel._poll_error("BRPOP")
        assert len(got) == 3
        assert channel._in_poll is None
