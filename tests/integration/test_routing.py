"""Prefix routing: a document's questions go to one worker, and never wait on a lost one.

Beside the stack's worker, the tests announce a phantom worker: its name and heartbeat are in
Redis as a live worker's would be, but no process consumes its queues (a worker that died
after its last heartbeat). Jobs routed to it must wait in its own queue, not run elsewhere;
once its heartbeat lapses the scheduler hands them to the shared queue and they run.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from core import keys
from core.models import Job
from core.queue.routing import pick_worker, prefix_key
from core.tiers import Tier
from tests.support import Stack, wait_final

PHANTOM = "phantom@inferq-test"
QUESTIONS = 5


@pytest.fixture
def phantom(stack: Stack) -> Iterator[str]:
    """A worker that looks live (until the test drops its heartbeat) and takes nothing."""
    stats = keys.worker_stats(PHANTOM)
    stack.redis.hset(stats, mapping={"in_flight": 0, "peak_in_flight": 0, "engine_requests": 0})
    stack.redis.sadd(keys.WORKERS_SET, PHANTOM)
    time.sleep(1.5)  # the API's view of the live workers is at most a second old
    try:
        yield PHANTOM
    finally:
        stack.redis.delete(stats)
        deadline = time.monotonic() + 30
        while any(stack.redis.llen(keys.worker_queue_name(t, PHANTOM)) for t in Tier):
            assert time.monotonic() < deadline, "the phantom's queues were not handed back"
            time.sleep(0.2)
        stack.redis.srem(keys.WORKERS_SET, PHANTOM)


def _documents(stack: Stack, workers: list[str]) -> dict[str, str]:
    """One document per worker, each routed to that worker."""
    chars = stack.local.settings.prefix_route_chars
    run = uuid.uuid4().hex[:6]
    documents: dict[str, str] = {}
    for n in itertools.count():
        document = " ".join(f"Clause {i} of contract {run}-{n} says nothing." for i in range(60))
        route = prefix_key(document, chars)
        assert route is not None, "the document is shorter than INFERQ_PREFIX_ROUTE_CHARS"
        worker = pick_worker(route, workers)
        assert worker is not None
        documents.setdefault(worker, document)
        if len(documents) == len(workers):
            return documents
    raise AssertionError("unreachable")


def _workers_of(stack: Stack, job_ids: list[str]) -> set[str | None]:
    with stack.db.session() as session:
        return set(session.scalars(select(Job.worker).where(Job.id.in_(job_ids))))


def _ask(stack: Stack, key: str, document: str, numbers: range) -> list[dict[str, Any]]:
    return [
        stack.submit(
            key, prompt=f"{document}\nQuestion {i}: what does it say?\nAnswer:", max_tokens=8
        )
        for i in numbers
    ]


def test_a_documents_questions_run_on_the_worker_its_prefix_routes_to(
    stack: Stack, phantom: str
) -> None:
    key = stack.create_key(Tier.STANDARD)
    documents = _documents(stack, sorted([stack.worker_name, phantom]))
    mine, lost = documents[stack.worker_name], documents[phantom]
    with stack.client(key) as client:
        # The first question computes the document; the rest find it in the prefix cache.
        first = wait_final(client, _ask(stack, key, mine, range(1))[0]["id"])
        rest = [
            wait_final(client, job["id"]) for job in _ask(stack, key, mine, range(1, QUESTIONS))
        ]
        waiting = _ask(stack, key, lost, range(QUESTIONS))
        time.sleep(2)
        # The phantom's questions wait for it, in its own queue, and nowhere else.
        assert stack.redis.llen(keys.worker_queue_name(Tier.STANDARD, phantom)) == QUESTIONS
        statuses = [client.get(f"/v1/jobs/{job['id']}").json()["status"] for job in waiting]
        assert statuses == ["queued"] * QUESTIONS
        assert stack.queue_lengths()[Tier.STANDARD.value] == QUESTIONS

        # Its heartbeat stops: the scheduler hands its queue back, and the questions run.
        stack.redis.delete(keys.worker_stats(phantom))
        answered = [wait_final(client, job["id"], timeout_s=120) for job in waiting]

    assert all(job["status"] == "succeeded" for job in [first, *rest, *answered])
    assert _workers_of(stack, [job["id"] for job in [first, *rest]]) == {stack.worker_name}
    assert _workers_of(stack, [job["id"] for job in answered]) == {stack.worker_name}
    for job in rest:
        assert job["usage"]["cached_prompt_tokens"] > job["usage"]["prompt_tokens"] // 2, job
    assert stack.queue_lengths()[Tier.STANDARD.value] == 0


def test_short_prompts_are_not_routed(stack: Stack, phantom: str) -> None:
    key = stack.create_key(Tier.STANDARD)
    with stack.client(key) as client:
        jobs = [stack.submit(key, prompt=f"Short question {i}?", max_tokens=4) for i in range(8)]
        done = [wait_final(client, job["id"], timeout_s=60) for job in jobs]
    assert all(job["status"] == "succeeded" for job in done)
    assert not any(stack.redis.llen(keys.worker_queue_name(t, phantom)) for t in Tier)


def test_jobs_are_routed_only_to_workers_that_take_their_tier(stack: Stack, phantom: str) -> None:
    """A worker started with `--tiers basic` gets routed basic jobs, never premium ones: those
    would wait in a queue of its that it does not read."""
    takes = {keys.worker_takes_field(tier): int(tier is Tier.BASIC) for tier in Tier}
    stack.redis.hset(keys.worker_stats(phantom), mapping=takes)
    time.sleep(1.5)  # the API's view of the live workers is at most a second old
    document = _documents(stack, sorted([stack.worker_name, phantom]))[phantom]
    premium, basic = stack.create_key(Tier.PREMIUM), stack.create_key(Tier.BASIC)
    with stack.client(premium) as client:
        done = [wait_final(client, job["id"]) for job in _ask(stack, premium, document, range(3))]
    assert [job["status"] for job in done] == ["succeeded"] * 3
    assert _workers_of(stack, [job["id"] for job in done]) == {stack.worker_name}
    assert stack.redis.llen(keys.worker_queue_name(Tier.PREMIUM, phantom)) == 0

    waiting = _ask(stack, basic, document, range(2))
    deadline = time.monotonic() + 10
    while stack.redis.llen(keys.worker_queue_name(Tier.BASIC, phantom)) < len(waiting):
        assert time.monotonic() < deadline, "the basic jobs were not routed to the phantom"
        time.sleep(0.1)
    # The fixture drops the phantom's heartbeat; its basic queue goes back to the shared one.
