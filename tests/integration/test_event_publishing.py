"""Publishing many jobs' events in one script call: each job's stream is as if published alone.

A worker publishes a whole engine step's deltas, and a batch's final events, in one call; this
checks on a real Redis that numbering, the live channel, the final event's key and the quota set
come out per job exactly as one call per event would leave them.
"""

from __future__ import annotations

import json
from pathlib import Path

import redis

from core import keys
from core.events import MAX_EVENTS_PER_CALL, EventPublisher, parse_events
from tests.support import command_calls, redis_server


def _events(client: redis.Redis, job_id: str) -> list[dict[str, object]]:
    return parse_events(client.xrange(keys.job_event_stream(job_id)))


def test_one_call_numbers_and_publishes_each_jobs_events_in_order(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        publisher = EventPublisher(client, ttl_s=60)
        # job_a counts against a key's concurrent jobs until its final event.
        client.set(keys.job_quota_set("job_a"), "quota:key1")
        client.zadd("quota:key1", {"job_a": 1, "job_other": 1})
        publisher.publish("job_a", "status", status="running", attempt=1)
        listener = client.pubsub()
        listener.subscribe(keys.job_events_channel("job_a"), keys.job_events_channel("job_b"))
        assert listener.get_message(timeout=1)  # the two subscribe confirmations
        assert listener.get_message(timeout=1)
        ends = client.pubsub()
        ends.subscribe(keys.FINAL_EVENTS_CHANNEL)
        assert ends.get_message(timeout=1)  # its subscribe confirmation

        before = command_calls(client)
        publisher.publish_many(
            [
                ("job_a", "delta", {"attempt": 1, "text": "Hel", "tokens": 3}),
                ("job_b", "delta", {"attempt": 1, "text": "x", "tokens": 1}),
                ("job_a", "delta", {"attempt": 1, "text": "lo", "tokens": 2}),
                ("job_a", "done", {"status": "succeeded"}),
                ("job_c", "cancelled", {"status": "cancelled"}),
            ]
        )
        calls = command_calls(client)
        assert "xlen" not in calls  # Redis numbers the entries
        # job_a's TTL restarted once (its final event), job_b's and job_c's set as they began
        assert calls["expire"] - before.get("expire", 0) == 3
        assert calls["publish"] - before.get("publish", 0) == 5 + 1  # both ends in one message

        a_events = _events(client, "job_a")
        assert [(e["seq"], e["type"]) for e in a_events] == [
            (1, "status"),
            (2, "delta"),
            (3, "delta"),
            (4, "done"),
        ]
        assert "".join(str(e.get("text", "")) for e in a_events) == "Hello"
        assert [(e["seq"], e["text"]) for e in _events(client, "job_b")] == [(1, "x")]
        live = []
        while (message := listener.get_message(timeout=1)) is not None:
            live.append(json.loads(message["data"]))
        assert [(e["job_id"], e["seq"]) for e in live] == [
            ("job_a", 2),
            ("job_b", 1),
            ("job_a", 3),
            ("job_a", 4),
        ]
        # job_a's final event took it off its key's quota set.
        assert client.zrange("quota:key1", 0, -1) == [b"job_other"]
        assert not client.exists(keys.job_quota_set("job_a"))
        assert 0 < client.ttl(keys.job_event_stream("job_b")) <= 60  # made by this call
        ended = [m["data"] for m in iter(lambda: ends.get_message(timeout=0.5), None)]
        assert ended == [b"job_a job_c"]


def test_more_events_than_one_call_takes_are_split_in_order(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        publisher = EventPublisher(client, ttl_s=60)
        count = MAX_EVENTS_PER_CALL * 2 + 3
        publisher.publish_many(
            [
                ("job_long", "delta", {"attempt": 1, "text": str(i), "tokens": 1})
                for i in range(count)
            ]
        )
        events = _events(client, "job_long")
        assert [e["seq"] for e in events] == list(range(1, count + 1))
        assert [e["text"] for e in events] == [str(i) for i in range(count)]


def test_a_streams_ttl_restarts_with_its_status_and_final_events_and_not_its_deltas(
    tmp_path: Path,
) -> None:
    """Deltas come only during a run, whose worker restarts the TTL (`restart_ttls`, from its
    heartbeat): they cost no EXPIRE, and a stream that begins with one still gets its TTL."""
    with redis_server(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        publisher = EventPublisher(client, ttl_s=60)
        stream = keys.job_event_stream("job_a")
        publisher.publish("job_a", "delta", attempt=1, text="a", tokens=1)
        assert 0 < client.ttl(stream) <= 60
        client.expire(stream, 30)
        publisher.publish_many([("job_a", "delta", {"attempt": 1, "text": "b", "tokens": 1})] * 5)
        assert client.ttl(stream) <= 30
        pipe = client.pipeline(transaction=False)
        publisher.restart_ttls(["job_a"], pipe)
        pipe.execute()
        assert client.ttl(stream) > 30
        client.expire(stream, 30)
        publisher.publish("job_a", "status", status="running", attempt=2)
        assert client.ttl(stream) > 30
        client.expire(stream, 30)
        publisher.publish("job_a", "done", status="succeeded")
        assert client.ttl(stream) > 30
        assert [e["seq"] for e in _events(client, "job_a")] == list(range(1, 9))
