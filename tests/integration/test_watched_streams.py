"""Deltas go out live only for jobs somebody follows; every stream still ends with the whole text.

A worker holds back the deltas of a job nobody reads and publishes them as one delta when a
reader comes (the text so far, then every delta live) or when the job ends. Readers through the
API (SSE, WebSocket) ask for live deltas; so does a subscriber to the job's Redis channel.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import redis

from core import keys
from core.events import EventPublisher, parse_events
from core.tiers import Tier
from tests.support import (
    BLOCKER_TOKENS,
    Stack,
    read_sse,
    redis_server,
    streamed_text,
    wait_final,
)
from workers.generation import Delta
from workers.streams import DeltaPublisher


def _stream(client: redis.Redis, job_id: str) -> list[dict[str, Any]]:
    return parse_events(client.xrange(keys.job_event_stream(job_id)))


def _wait_running(stack: Stack, key: str, job_id: str) -> None:
    with stack.client(key) as client:
        deadline = time.monotonic() + 120
        while client.get(f"/v1/jobs/{job_id}").json()["status"] != "running":
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.1)


def test_a_job_nobody_follows_streams_its_text_as_one_delta_at_the_end(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    job = stack.submit(key, prompt="Nobody reads me live.", max_tokens=200, ignore_eos=True)
    with stack.client(key) as client:
        done = wait_final(client, job["id"])
    events = _stream(stack.redis, job["id"])
    assert [e["type"] for e in events] == ["status", "delta", "done"]
    assert events[1]["text"] == done["text"] and events[1]["tokens"] == 200
    # A reader after the end gets that whole stream.
    with stack.client(key) as client:
        assert streamed_text(read_sse(client, job["id"])) == done["text"]


def test_a_reader_arriving_mid_run_gets_the_text_so_far_then_live_deltas(stack: Stack) -> None:
    key = stack.create_key(Tier.PREMIUM)  # the tier whose cap allows a long job
    job = stack.submit(key, prompt="Join me late.", max_tokens=BLOCKER_TOKENS, ignore_eos=True)
    _wait_running(stack, key, job["id"])
    time.sleep(1)  # it generates unwatched meanwhile
    with stack.client(key) as client:
        first = read_sse(client, job["id"], max_events=6)
        assert client.delete(f"/v1/jobs/{job['id']}").status_code in (200, 202)
        cancelled = wait_final(client, job["id"])
        replay = read_sse(client, job["id"])
    assert [e["type"] for e in first] == ["status"] + ["delta"] * 5
    assert first[1]["tokens"] > 1  # the text made before the reader came, in one delta
    assert replay[: len(first)] == first
    assert cancelled["status"] == "cancelled"
    assert streamed_text(replay) == cancelled["text"]


def test_a_redis_subscriber_gets_live_deltas_too(stack: Stack) -> None:
    key = stack.create_key(Tier.PREMIUM)  # the tier whose cap allows a long job
    job = stack.submit(key, prompt="Subscribe to me.", max_tokens=BLOCKER_TOKENS, ignore_eos=True)
    _wait_running(stack, key, job["id"])
    # A job is running from before its prefill: give it time to make some tokens unwatched, or
    # the text so far could be its first token alone.
    time.sleep(1)
    subscriber = stack.redis.pubsub(ignore_subscribe_messages=True)
    subscriber.subscribe(keys.job_events_channel(job["id"]))
    try:
        deltas: list[dict[str, Any]] = []
        deadline = time.monotonic() + 60
        while len(deltas) < 3 and time.monotonic() < deadline:
            message = subscriber.get_message(timeout=1.0)
            if message and message["type"] == "message":
                event = json.loads(message["data"])
                deltas += [event] if event["type"] == "delta" else []
    finally:
        subscriber.close()
        with stack.client(key) as client:
            client.delete(f"/v1/jobs/{job['id']}")
            wait_final(client, job["id"])
    # Within a heartbeat of subscribing: the text so far, then deltas as they are made.
    assert len(deltas) == 3
    assert deltas[0]["tokens"] > 1  # what the job made before anybody watched, in one delta
    assert [d["seq"] for d in deltas] == sorted(d["seq"] for d in deltas)


def test_held_deltas_keep_their_order_around_a_watch(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        deltas = DeltaPublisher(EventPublisher(client, ttl_s=60))
        deltas.publish_events([("job_a", "status", {"status": "running", "attempt": 1})])
        deltas.publish_step([Delta("job_a", 1, "He", 1), Delta("job_b", 1, "x", 1)])
        deltas.publish_step([Delta("job_a", 1, "llo", 1)])
        deltas.watch("job_c")  # not running here: ignored, so job_c's deltas stay held
        deltas.flush([])
        assert [e["type"] for e in _stream(client, "job_a")] == ["status"]
        assert _stream(client, "job_b") == []

        deltas.watch("job_a")
        deltas.publish_step([Delta("job_a", 1, ", ", 1)])
        deltas.flush([])
        assert [e.get("text") for e in _stream(client, "job_a")] == [None, "Hello", ", "]

        deltas.publish_step([Delta("job_c", 1, "c", 1), Delta("job_a", 1, "world", 1)])
        deltas.flush(["job_a", "job_b"])
        assert "".join(e.get("text", "") for e in _stream(client, "job_a")) == "Hello, world"
        assert [(e["text"], e["tokens"]) for e in _stream(client, "job_b")] == [("x", 1)]
        assert _stream(client, "job_c") == []
        deltas.flush(["job_c"])
        assert [e["text"] for e in _stream(client, "job_c")] == ["c"]
