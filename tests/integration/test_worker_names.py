"""Worker names: workers on one host get distinct names, and a name is held by one live process.

Two workers started on one host without a name once both went by `cpu@host`: Celery saw one
node answer twice, and the jobs of the two were mixed up under one name. Now each claims the
first free name for its devices in Redis (`cpu@host`, `cpu.2@host`, …), and one started with a
name that a live worker holds exits saying so.
"""

from __future__ import annotations

import itertools
import re
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from sqlalchemy import select

from core import keys
from core.models import Job
from core.queue.app import make_celery_app
from core.queue.routing import pick_worker, prefix_key
from core.tiers import Tier
from core.workerinfo import live_workers
from core.workernames import (
    NAME_TTL_S,
    STARTING_TTL_S,
    WorkerNameTaken,
    claim_first_free,
    claim_name,
)
from tests.support import ExtraWorker, Stack, read_sse, streamed_text, wait_final
from workers.devices import DeviceSpec

CANCEL_TOKENS = 2000
JOBS_PER_WORKER = 6
STALLS = 6
STALL_S = 4.5
"""Most of the name's TTL (5 s by default): past the 4 s at which the old watchdog dumped."""
STALL_TOKENS = 300


# The claims themselves, on the session's Redis, under a host name of each test's own.


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


@pytest.fixture
def host() -> str:
    return f"names-{uuid.uuid4().hex[:8]}"


def test_workers_of_the_same_devices_take_the_first_free_names(
    client: redis.Redis, host: str
) -> None:
    first = claim_first_free(client, DeviceSpec("cpu").node_names(host))
    second = claim_first_free(client, DeviceSpec("cpu").node_names(host))
    gpu = claim_first_free(client, DeviceSpec("cuda", (0,)).node_names(host))
    assert [first.name, second.name, gpu.name] == [f"cpu@{host}", f"cpu.2@{host}", f"gpu0@{host}"]
    # Held long while the worker loads its engine, then by short renewals.
    assert 10 < client.ttl(keys.worker_name_claim(first.name)) <= STARTING_TTL_S
    first.started()
    assert 0 < client.ttl(keys.worker_name_claim(first.name)) <= NAME_TTL_S
    first.release()
    third = claim_first_free(client, DeviceSpec("cpu").node_names(host))
    assert third.name == f"cpu@{host}"  # a released name is free again
    for claim in (second, gpu, third):
        claim.release()
    assert not client.keys(keys.worker_name_claim(f"*@{host}"))


def test_a_claim_outlives_its_ttl_while_its_process_renews_it(
    client: redis.Redis, host: str
) -> None:
    claim = claim_name(client, f"cpu@{host}", ttl_s=0.6)
    claim.started()
    time.sleep(1.5)
    assert client.get(keys.worker_name_claim(claim.name)) == claim.token.encode()
    with pytest.raises(
        WorkerNameTaken, match=re.escape(f"a live worker already goes by {claim.name!r}")
    ):
        claim_name(client, claim.name, ttl_s=0.6)  # waits its TTL and a second more
    claim.release()


def test_a_process_stalled_past_its_claims_renewal_logs_how_late(
    client: redis.Redis, host: str, caplog: Any
) -> None:
    claim = claim_name(client, f"cpu@{host}", ttl_s=0.6)
    claim.started()
    time.sleep(0.5)  # a renewal on time first: the stall below makes the next one late
    # A thread that keeps the GIL (as a long call into a C extension does) stalls the renewer.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        stalled = time.monotonic()
        while time.monotonic() - stalled < 1.0:
            pass
    finally:
        sys.setswitchinterval(interval)
    time.sleep(0.5)  # the renewer's next turn
    claim.release()
    assert "renewed" in caplog.text and "after the last renewal" in caplog.text


def test_a_named_worker_waits_for_the_claim_of_a_process_that_died(
    client: redis.Redis, host: str
) -> None:
    name = f"cpu@{host}"
    # What a killed worker leaves behind: a claim nobody renews.
    client.set(keys.worker_name_claim(name), "a process that died", px=1500)
    started = time.monotonic()
    claim = claim_name(client, name, ttl_s=2)
    assert 1.0 < time.monotonic() - started < 10
    assert client.get(keys.worker_name_claim(name)) == claim.token.encode()
    claim.release()


def test_a_claim_redis_lost_is_taken_again_and_anothers_is_left_alone(
    client: redis.Redis, host: str
) -> None:
    claim = claim_name(client, f"cpu@{host}", ttl_s=0.6)
    key = keys.worker_name_claim(claim.name)
    client.delete(key)  # as a Redis restarted without its data
    deadline = time.monotonic() + 10
    while client.get(key) != claim.token.encode():
        assert time.monotonic() < deadline, "the lost claim was not taken again"
        time.sleep(0.05)
    # Another process took the name while this one stalled: neither renewing nor releasing
    # takes it from that process.
    client.set(key, "another process", px=60_000)
    assert claim.renew() is False
    claim.release()
    assert client.get(key) == b"another process"
    client.delete(key)


# Worker processes on the stack.


@pytest.fixture(scope="module")
def second_worker(stack: Stack) -> Iterator[ExtraWorker]:
    """A second CPU worker beside the stack's own, started without a name."""
    worker = ExtraWorker(stack, f"cpu.2@{socket.gethostname()}", named=False)
    with worker.running():
        time.sleep(1.5)  # the API's view of the live workers (for routing) is up to 1 s old
        yield worker


def test_two_workers_started_on_one_host_without_a_name_get_distinct_node_names(
    stack: Stack, second_worker: ExtraWorker
) -> None:
    host = socket.gethostname()
    assert (stack.worker_name, second_worker.name) == (f"cpu@{host}", f"cpu.2@{host}")
    for name in (stack.worker_name, second_worker.name):
        assert stack.redis.exists(keys.worker_name_claim(name))
    # Celery sees two nodes, each answering once (one name for two workers answered twice).
    app = make_celery_app(stack.local.settings)
    try:
        deadline = time.monotonic() + 60
        while True:
            # A worker only just ready may not be subscribed to remote control yet: ask again.
            answered = [node for reply in app.control.ping(timeout=2.0) for node in reply]
            if {stack.worker_name, second_worker.name} <= set(answered):
                break
            assert time.monotonic() < deadline, f"not both answered Celery's ping: {answered}"
    finally:
        app.close()
    assert answered.count(stack.worker_name) == 1
    assert answered.count(second_worker.name) == 1


def test_a_worker_named_like_a_live_worker_exits_saying_so(stack: Stack) -> None:
    impostor = ExtraWorker(stack, stack.worker_name)
    impostor.log = impostor.log.with_name("impostor.log")
    impostor.start()
    assert impostor.process is not None
    try:
        code = impostor.process.wait(timeout=180)
    finally:
        if impostor.process.poll() is None:
            impostor.kill()
    assert code != 0
    assert f"a live worker already goes by '{stack.worker_name}'" in impostor.log.read_text()
    # The worker that holds the name goes on as before.
    assert stack.worker_name in live_workers(stack.redis)
    assert stack.redis.exists(keys.worker_name_claim(stack.worker_name))


def test_a_worker_stopped_for_most_of_its_names_ttl_again_and_again_lives_on(
    stack: Stack, second_worker: ExtraWorker
) -> None:
    """A host that stalls (a VM paused, SIGSTOP) and goes on must not take its worker with it.

    Each stall here stops the worker and its engine for most of the name's TTL, while jobs routed
    to it wait or run. A watchdog that dumped every thread's stack when a renewal came that late
    (`faulthandler`, from a thread without the GIL) crashed the worker in mid-dump, about one
    stall in five, with its engine core left behind.
    """
    key = stack.create_key(Tier.PREMIUM)
    assert second_worker.process is not None
    ran: list[str] = []
    with stack.client(key) as client:
        for stall in range(STALLS):
            # Every other prompt routes to the second worker (see `_prompts_routed_to`).
            prompts = _prompts_routed_to(stack, [stack.worker_name, second_worker.name])[1::2]
            jobs = [
                stack.submit(key, prompt=prompt, max_tokens=STALL_TOKENS, ignore_eos=True)
                for prompt in prompts[:3]
            ]
            with second_worker.frozen():
                time.sleep(STALL_S)
            time.sleep(0.5)  # its threads run again: the renewal, the publisher, the engine
            assert second_worker.process.poll() is None, (
                f"the worker died after stall {stall + 1}; see {second_worker.log}"
            )
            for job in jobs:
                done = wait_final(client, job["id"])
                assert done["status"] == "succeeded", (done["id"], done["status"])
                assert done["usage"]["completion_tokens"] == STALL_TOKENS
                ran.append(done["id"])
    assert second_worker.process.poll() is None, f"the worker died; see {second_worker.log}"
    # It still takes and runs the jobs routed to it.
    assert second_worker.name in _workers_of(stack, ran)


def test_cancelling_running_jobs_on_two_workers_always_ends_them_cancelled(
    stack: Stack, second_worker: ExtraWorker
) -> None:
    key = stack.create_key(Tier.PREMIUM)
    workers = [stack.worker_name, second_worker.name]
    # Routed by prompt prefix, half of the jobs run on each worker, both at once.
    to_run = _prompts_routed_to(stack, workers)
    cancelled: list[dict[str, Any]] = []
    with stack.client(key) as client:
        # A job that ended before its cancel reached it (a stalled test process, API or worker
        # on a busy host: the engine goes on meanwhile) was never cancelled while it ran, and
        # ends as it would have: it is run again, up to three times. A worker that lost or
        # ignored cancels would fail all three.
        for _ in range(3):
            prompts: dict[str, str] = {}  # job id → its prompt
            for prompt in to_run:
                job = stack.submit(key, prompt=prompt, max_tokens=CANCEL_TOKENS, ignore_eos=True)
                prompts[job["id"]] = prompt
            deleted = _delete_each_once_running(stack, key, list(prompts))
            ended = [wait_final(client, job_id) for job_id in deleted]
            assert {job["status"] for job in ended} <= {"cancelled", "succeeded"}, ended
            cancelled += [job for job in ended if job["status"] == "cancelled"]
            kept = {job["id"] for job in cancelled}
            to_run = [prompt for job_id, prompt in prompts.items() if job_id not in kept]
            if not to_run:
                break
        for job in cancelled:
            summary = (job["id"], job["finish_reason"], job["usage"]["completion_tokens"])
            assert job["finish_reason"] == "cancelled", summary
            assert job["usage"]["completion_tokens"] < CANCEL_TOKENS, summary
            # Its partial text: what its stream carried up to the cancel.
            assert streamed_text(read_sse(client, job["id"])) == job["text"], summary
    assert not to_run, f"{len(to_run)} jobs kept ending before they could be cancelled"
    assert _workers_of(stack, [job["id"] for job in cancelled]) == set(workers)


def _prompts_routed_to(stack: Stack, workers: list[str]) -> list[str]:
    """`JOBS_PER_WORKER` prompts whose prefix routes each worker its share."""
    chars = stack.local.settings.prefix_route_chars
    run = uuid.uuid4().hex[:6]
    prompts: dict[str, list[str]] = {worker: [] for worker in workers}
    for n in itertools.count():
        prompt = " ".join(f"Line {i} of cancel trial {run}-{n}." for i in range(40))
        worker = pick_worker(prefix_key(prompt, chars) or "", workers)
        assert worker is not None and len(prompt) >= chars
        if len(prompts[worker]) < JOBS_PER_WORKER:
            prompts[worker].append(prompt)
        if all(len(mine) == JOBS_PER_WORKER for mine in prompts.values()):
            return [prompt for pair in zip(*prompts.values(), strict=True) for prompt in pair]
    raise AssertionError("unreachable")


def _delete_each_once_running(stack: Stack, key: str, job_ids: list[str]) -> set[str]:
    """DELETE each job as soon as it shows running; the ids of those whose DELETE was accepted
    (200 or 202: the job may still have ended before its worker saw the cancel).

    One poller lists the key's jobs (a request per look, not one per job), and each DELETE,
    which waits for its job to end, goes out from a thread of its own. A job that ended before
    its DELETE was answered (409) was not cancelled while it ran, and is left out.
    """
    waiting = set(job_ids)
    answers = {}
    with stack.client(key) as client, ThreadPoolExecutor(len(job_ids)) as pool:
        deadline = time.monotonic() + 180
        while waiting:
            assert time.monotonic() < deadline, f"{len(waiting)} jobs did not start"
            page = client.get("/v1/jobs", params={"limit": 100})
            assert page.status_code == 200, page.text
            statuses = {job["id"]: job["status"] for job in page.json()["data"]}
            for job_id in [i for i in waiting if statuses[i] != "queued"]:
                waiting.discard(job_id)
                if statuses[job_id] == "running":
                    answers[job_id] = pool.submit(_delete, stack, key, job_id)
            time.sleep(0.05)
        codes = {job_id: answer.result() for job_id, answer in answers.items()}
    assert set(codes.values()) <= {200, 202, 409}, codes
    return {job_id for job_id, code in codes.items() if code != 409}


def _delete(stack: Stack, key: str, job_id: str) -> int:
    with stack.client(key) as client:
        return client.delete(f"/v1/jobs/{job_id}").status_code


def _workers_of(stack: Stack, job_ids: list[str]) -> set[str | None]:
    with stack.db.session() as session:
        return set(session.scalars(select(Job.worker).where(Job.id.in_(job_ids))))
