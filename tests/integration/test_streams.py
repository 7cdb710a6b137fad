"""Token streams: SSE with replay and resume, and the WebSocket, on the real engine."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
from websockets.sync.client import ClientConnection, connect

from core import keys
from core.events import EventPublisher
from core.jobs import JobStore
from core.new_jobs import NewJob
from core.states import JobStatus
from core.tiers import Tier
from tests.netcut import cut_redis_connections
from tests.support import (
    BLOCKER_TOKENS,
    FINAL_EVENTS,
    Stack,
    read_sse,
    redis_server,
    streamed_text,
    wait_final,
    worker_paused,
)
from workers.generation import Delta, GenerationResult
from workers.leases import Leases
from workers.outcomes import OutcomeRecorder
from workers.streams import DeltaPublisher


def _check_stream(events: list[dict[str, Any]]) -> None:
    """Numbered 1..n without gaps, one final event, and it is the last."""
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    finals = [e for e in events if e["type"] in FINAL_EVENTS]
    assert finals == [events[-1]]


def test_streamed_deltas_equal_the_stored_text(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    jobs = [
        stack.submit(key, prompt=f"Stream {i}: ü 漢字", max_tokens=300, ignore_eos=True)
        for i in range(3)
    ]
    with stack.client(key) as client:
        for index, job in enumerate(jobs):
            events = read_sse(client, job["id"])
            _check_stream(events)
            done = wait_final(client, job["id"])
            assert events[-1]["type"] == "done" and events[-1]["status"] == "succeeded"
            assert events[-1]["usage"]["completion_tokens"] == 300
            deltas = [e for e in events if e["type"] == "delta"]
            assert sum(e["tokens"] for e in deltas) == 300
            assert len(done["text"]) > 250  # the local model writes printable text
            assert streamed_text(events).encode() == done["text"].encode()
            if index == 0:  # followed from its start; the others may have ended unread
                assert len(deltas) > 1


def test_resume_with_last_event_id_loses_and_repeats_nothing(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    job = stack.submit(key, prompt="Resume me.", max_tokens=400, ignore_eos=True)
    with stack.client(key) as client:
        first = read_sse(client, job["id"], max_events=4)
        assert len(first) == 4
        rest = read_sse(client, job["id"], last_event_id=first[-1]["seq"])
        # A reader that comes after the end gets the whole stream replayed.
        replay = read_sse(client, job["id"])
        done = wait_final(client, job["id"])
    assert first + rest == replay
    _check_stream(replay)
    assert streamed_text(replay) == done["text"]
    # Resuming after the final event: the final event again, nothing else is invented.
    with stack.client(key) as client:
        again = read_sse(client, job["id"], last_event_id=replay[-1]["seq"])
    assert [e["type"] for e in again] == [replay[-1]["type"]]


def test_a_stream_outlives_the_apis_redis_connections_dropping(stack: Stack) -> None:
    """A reader waiting on a job whose API process loses its Redis connections (a network
    blip, a proxy's idle timeout) keeps its stream: every event once, up to the final one."""
    key = stack.create_key(Tier.STANDARD)
    api_pid = next(process.pid for name, process in stack.local.processes if name == "api")
    with stack.client(key) as client, ThreadPoolExecutor(1) as pool:
        with worker_paused(stack):  # the job waits, its reader blocked on Redis for the next event
            job = stack.submit(key, prompt="Outlive the blip.", max_tokens=200, ignore_eos=True)
            reader = pool.submit(read_sse, client, job["id"])
            deadline = time.monotonic() + 30
            while not stack.redis.exists(keys.job_watched(job["id"])):
                assert time.monotonic() < deadline, "the reader did not connect"
                time.sleep(0.05)
            time.sleep(0.5)
            assert cut_redis_connections(stack.redis, api_pid) > 0
        events = reader.result(timeout=120)
        done = wait_final(client, job["id"])
    _check_stream(events)
    assert events[-1]["type"] == "done" and done["status"] == "succeeded"
    assert streamed_text(events) == done["text"]


@pytest.mark.parametrize("bad", ["abc", "-1", "1.5", "0x10", "9" * 30])
def test_malformed_last_event_id_is_400(stack: Stack, bad: str) -> None:
    key = stack.create_key(Tier.BASIC)
    job = stack.submit(key, prompt="x", max_tokens=1)
    with stack.client(key) as client:
        response = client.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": bad})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"
    assert response.json()["error"]["param"] == "Last-Event-ID"


def test_events_of_unknown_or_foreign_jobs_are_404(stack: Stack) -> None:
    owner_key, other_key = stack.create_key(), stack.create_key()
    job = stack.submit(owner_key, prompt="mine", max_tokens=1)
    with stack.client(other_key) as client:
        for job_id in (job["id"], "job_doesnotexist"):
            response = client.get(f"/v1/jobs/{job_id}/events")
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "not_found"
    with stack.client(None) as client:
        assert client.get(f"/v1/jobs/{job['id']}/events").status_code == 401


def _ws(stack: Stack, key: str | None) -> ClientConnection:
    url = stack.api_url.replace("http://", "ws://") + "/v1/ws"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return connect(url, additional_headers=headers, open_timeout=30)


def _receive(ws: ClientConnection) -> dict[str, Any]:
    message: dict[str, Any] = json.loads(ws.recv(timeout=120))
    return message


def test_websocket_runs_two_jobs_on_one_socket(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    events: dict[str, list[dict[str, Any]]] = {}
    accepted: dict[str, str] = {}
    with _ws(stack, key) as ws:
        for ref in ("a", "b"):
            job = {"prompt": f"Socket job {ref}.", "max_tokens": 120, "ignore_eos": True}
            ws.send(json.dumps({"type": "submit", "ref": ref, "job": job}))
        ws.send("this is not json")  # an error event, and the socket stays usable
        ws.send(json.dumps({"type": "submit", "ref": "c", "job": {"prompt": ""}}))
        ws.send(json.dumps({"type": "dance"}))
        ws.send(json.dumps({"type": "subscribe", "ref": "d", "job_id": "job_nope"}))
        errors = []
        while len(accepted) < 2 or any(
            not evs or evs[-1]["type"] not in FINAL_EVENTS for evs in events.values()
        ):
            message = _receive(ws)
            if message["type"] == "accepted":
                accepted[message["ref"]] = message["job"]["id"]
                events.setdefault(message["job"]["id"], [])
            elif message["type"] == "error":
                errors.append(message)
            else:
                events.setdefault(message["job_id"], []).append(message)
    assert sorted(accepted) == ["a", "b"]
    codes = sorted((e["ref"] or "", e["error"]["code"]) for e in errors)
    assert codes == [
        ("", "invalid_request"),
        ("", "invalid_request"),
        ("c", "invalid_request"),
        ("d", "not_found"),
    ]
    with stack.client(key) as client:
        for job_id in accepted.values():
            _check_stream(events[job_id])
            done = wait_final(client, job_id)
            assert done["status"] == "succeeded"
            assert streamed_text(events[job_id]) == done["text"]


def test_closing_the_socket_cancels_its_jobs_unless_asked_not_to(stack: Stack) -> None:
    key = stack.create_key(Tier.PREMIUM)
    long_job = {"prompt": "Long.", "max_tokens": BLOCKER_TOKENS, "ignore_eos": True}
    with _ws(stack, key) as ws:
        ws.send(json.dumps({"type": "submit", "ref": "cancel-me", "job": long_job}))
        ws.send(
            json.dumps(
                {"type": "submit", "ref": "keep", "job": long_job, "cancel_on_disconnect": False}
            )
        )
        ids: dict[str, str] = {}
        deltas = 0
        while len(ids) < 2 or deltas < 2:
            message = _receive(ws)
            if message["type"] == "accepted":
                ids[message["ref"]] = message["job"]["id"]
            deltas += message["type"] == "delta"
    with stack.client(key) as client:
        cancelled = wait_final(client, ids["cancel-me"], timeout_s=60)
        assert cancelled["status"] == "cancelled"
        kept = client.get(f"/v1/jobs/{ids['keep']}").json()
        assert kept["status"] == "running"
        assert client.delete(f"/v1/jobs/{ids['keep']}").json()["status"] == "cancelled"


def test_websocket_without_a_valid_key_is_refused_with_401(stack: Stack) -> None:
    from websockets.exceptions import InvalidStatus

    for key in (None, "iq_not_a_real_key"):
        with pytest.raises(InvalidStatus) as refused:
            _ws(stack, key)
        assert refused.value.response.status_code == 401
        assert json.loads(refused.value.response.body)["error"]["code"] == "invalid_api_key"


def test_submitting_with_stream_answers_with_the_jobs_events(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    body = {"prompt": "Submit and stream.", "max_tokens": 80, "ignore_eos": True}
    with (
        stack.client(key) as client,
        client.stream("POST", "/v1/jobs", params={"stream": "true"}, json=body) as response,
    ):
        assert response.status_code == 200
        job_id = response.headers["location"].rsplit("/", 1)[-1]
        events = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")
        ]
    _check_stream(events)
    assert {e["job_id"] for e in events} == {job_id}
    with stack.client(key) as client:
        done = wait_final(client, job_id)
    assert events[-1]["type"] == "done"
    assert streamed_text(events) == done["text"]


def test_a_streaming_client_that_goes_away_cancels_its_job_unless_asked_not_to(
    stack: Stack,
) -> None:
    key = stack.create_key(Tier.PREMIUM)
    body = {"prompt": "Abandon me.", "max_tokens": BLOCKER_TOKENS, "ignore_eos": True}
    ids = []
    for params in ({"stream": "true"}, {"stream": "true", "cancel_on_disconnect": "false"}):
        with (
            stack.client(key) as client,
            client.stream("POST", "/v1/jobs", params=params, json=body) as response,
        ):
            ids.append(response.headers["location"].rsplit("/", 1)[-1])
            deltas = 0
            for line in response.iter_lines():
                deltas += line.startswith("event: delta")
                if deltas == 2:
                    break  # and close the connection
    with stack.client(key) as client:
        assert wait_final(client, ids[0], timeout_s=60)["status"] == "cancelled"
        assert client.get(f"/v1/jobs/{ids[1]}").json()["status"] == "running"
        assert client.delete(f"/v1/jobs/{ids[1]}").json()["status"] == "cancelled"


def test_a_job_is_stored_final_only_after_its_deltas_are_published(stack: Stack) -> None:
    """A worker killed between the two must not leave a final job whose stream stops short."""
    store = JobStore(stack.db)
    job, _ = store.create(
        NewJob(
            owner="probe",
            tier=Tier.BASIC.value,
            prompt="p",
            sampling_params={},
            timeout_s=60,
            prompt_tokens=1,
        )
    )
    (job,) = store.start_attempts({job.id: job.attempt}, "probe@inferq-test")
    publisher = EventPublisher(stack.redis, ttl_s=60)
    deltas = DeltaPublisher(publisher)
    status_when_flushed: list[str] = []

    def flush(job_ids: list[str]) -> None:
        row = store.get(job.id)
        assert row is not None
        status_when_flushed.append(row.status)
        deltas.flush(job_ids)

    recorder = OutcomeRecorder(store, publisher, Leases(stack.redis, 60), before_final=flush)
    deltas.publish_step(
        [Delta(job.id, job.attempt, "Hello, ", 2), Delta(job.id, job.attempt, "world", 1)]
    )
    result = GenerationResult(JobStatus.SUCCEEDED, text="Hello, world", completion_tokens=3)
    assert recorder.record(job, result, lease_token="t") is JobStatus.SUCCEEDED

    assert status_when_flushed == ["running"]
    entries: list[tuple[bytes, dict[bytes, bytes]]] = stack.redis.xrange(  # type: ignore[assignment]
        keys.job_event_stream(job.id)
    )
    events = [json.loads(fields[b"e"]) for _, fields in entries]
    assert [e["type"] for e in events] == ["delta", "done"]
    assert "".join(e["text"] for e in events if e["type"] == "delta") == "Hello, world"


def test_deltas_redis_did_not_take_go_out_once_it_is_back(tmp_path: Path) -> None:
    """A stream keeps its whole text across a Redis outage: deltas made while Redis is away
    are kept, and sent in order before newer ones (a failover, a restart)."""
    with redis_server(tmp_path) as server:
        client = redis.Redis.from_url(server.url, socket_connect_timeout=1, socket_timeout=2)
        deltas = DeltaPublisher(EventPublisher(client, ttl_s=60), unsent_retry_s=1.0)
        deltas.publish_events([("job_a", "status", {"status": "running", "attempt": 1})])
        deltas.watch("job_a")  # its deltas go out live
        deltas.publish_step([Delta("job_a", 1, "one ", 1)])
        deltas.flush(["job_b"])
        server.stop()
        deltas.publish_step([Delta("job_a", 1, "two ", 1)])  # Redis is away: kept
        deltas.flush(["job_b"])
        server.start()  # back, empty: what was sent before is gone, what was kept is not
        client.connection_pool.disconnect()
        deltas.publish_step([Delta("job_a", 1, "three", 1)])
        deltas.flush()
        entries: Any = client.xrange(keys.job_event_stream("job_a"))
    texts = [json.loads(fields[b"e"]).get("text") for _, fields in entries]
    assert "".join(text for text in texts if text) == "two three"
