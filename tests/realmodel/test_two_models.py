"""Two base models through one queue: the demo model and the tiny one, each on a worker of its
own, on a stack of their own (Redis, SQLite, API, scheduler). Each job runs on a worker of its
model, in tier order within that model's queues; a model nobody serves stores nothing."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from core import keys
from core.modelinfo import served_model_name
from core.models import Job
from core.tiers import Tier
from tests.otlp import OtlpReceiver
from tests.realmodel.conftest import DemoStack, template_token_count
from tests.stacks import STACK_TIERS, stack_of_its_own
from tests.support import ExtraWorker, Stack, wait_final
from workers.devices import OMP_BIND_VARIABLE

pytestmark = pytest.mark.realmodel

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
DEMO_SLOTS = 2
"""The demo model's worker runs two jobs at a time: two long jobs fill it."""
BASIC = 40


@dataclass
class TwoModels:
    stack: Stack
    """Its own worker serves the tiny model, the first (INFERQ_MODEL)."""
    tiny: str
    demo: str
    demo_worker: ExtraWorker
    """Serves the demo model (INFERQ_MODELS, `inferq worker --model`)."""
    demo_model_dir: Path


@pytest.fixture(scope="module")
def two_models(
    demo_stack: DemoStack, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TwoModels]:
    demo = served_model_name(str(demo_stack.model_dir))
    otlp = OtlpReceiver()
    try:
        with stack_of_its_own(
            tmp_path_factory.mktemp("two-models"),
            model_dir,
            otlp.url,
            env={
                "INFERQ_MODELS": json.dumps({demo: str(demo_stack.model_dir)}),
                # No aging and a long deadline: the tier-order test's basic jobs wait behind
                # long jobs for as long as this machine takes; they would otherwise move ahead
                # of its premium ones, or time out in the queue.
                "INFERQ_TIERS": json.dumps(
                    {
                        **STACK_TIERS,
                        "standard": {"promote_after_s": None},
                        "basic": {"promote_after_s": None, "timeout_s": 600},
                    }
                ),
            },
            max_model_len=None,  # each model's own
        ) as stack:
            worker = ExtraWorker(
                stack,
                "demo@two-models",
                concurrency=DEMO_SLOTS,
                # Its forward pass on any core, as a host's second worker's (`cpu.2@host`)
                # would be: vLLM binds both engines to core 0 otherwise.
                env={OMP_BIND_VARIABLE: "nobind"},
                args=["--model", demo],
            )
            with worker.running():
                yield TwoModels(stack, stack.model_name, demo, worker, demo_stack.model_dir)
    finally:
        otlp.close()


def _workers_of(stack: Stack, jobs: list[dict[str, Any]]) -> set[str | None]:
    with stack.db.session() as session:
        ids = [job["id"] for job in jobs]
        return set(session.scalars(select(Job.worker).where(Job.id.in_(ids))))


def _started_count(stack: Stack, tier: Tier, lane: str | None) -> int:
    """Jobs of a tier and lane the workers counted as started, in the live rate buckets."""
    pattern = keys.started_tier_bucket(tier, 0, lane).removesuffix(":0") + ":*"
    return sum(int(stack.redis.get(name) or 0) for name in stack.redis.scan_iter(match=pattern))


def _started(job: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(job["created_at"]) + timedelta(seconds=job["timings"]["queue_s"])


def test_models_lists_both_models_with_the_workers_that_serve_each(two_models: TwoModels) -> None:
    stack = two_models.stack
    with stack.client(stack.create_key()) as client:
        cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
        assert set(cards) == {two_models.tiny, two_models.demo}
        assert cards[two_models.tiny]["workers"] == [stack.worker_name]
        assert cards[two_models.demo]["workers"] == [two_models.demo_worker.name]
        assert client.get(f"/v1/models/{two_models.demo}").status_code == 200


def test_each_job_runs_on_a_worker_of_its_model(two_models: TwoModels) -> None:
    stack = two_models.stack
    key = stack.create_key(Tier.STANDARD)
    with stack.client(key) as client:
        bodies = [
            {"prompt": f"Job {i} of either model.", "max_tokens": 8, "model": model}
            for i in range(6)
            for model in (two_models.tiny, two_models.demo)
        ]
        response = client.post("/v1/jobs/batch", json={"jobs": bodies})
        assert response.status_code == 202, response.text
        jobs = response.json()["data"]
        finals = [wait_final(client, job["id"], timeout_s=240) for job in jobs]
        assert [job["status"] for job in finals] == ["succeeded"] * len(jobs), finals
        assert [job["model"] for job in finals] == [body["model"] for body in bodies]
        tiny = [job for job in finals if job["model"] == two_models.tiny]
        demo = [job for job in finals if job["model"] == two_models.demo]
        assert _workers_of(stack, tiny) == {stack.worker_name}
        assert _workers_of(stack, demo) == {two_models.demo_worker.name}

        # The demo model's chat template and tokenizer, through the OpenAI surface (what its
        # greedy answer says depends on the CPU's arithmetic: bf16 or float32).
        reply = client.post(
            "/v1/chat/completions",
            json={"model": two_models.demo, "messages": FRANCE, "temperature": 0, "max_tokens": 16},
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == two_models.demo
        assert reply.json()["choices"][0]["message"]["content"].strip()
        demo_dir = two_models.demo_model_dir
        assert reply.json()["usage"]["prompt_tokens"] == template_token_count(demo_dir, FRANCE)


def test_a_models_jobs_keep_tier_order_and_do_not_wait_for_the_other_model(
    two_models: TwoModels,
) -> None:
    stack, demo = two_models.stack, two_models.demo
    stack.forget_measured_load()  # its backlog is deliberate: admission is not what it tests
    basic_key, premium_key = stack.create_key(Tier.BASIC), stack.create_key(Tier.PREMIUM)
    with stack.client(basic_key) as basic, stack.client(premium_key) as premium:
        # Every slot of the demo model's worker busy with a long job.
        blockers = [
            stack.submit(
                premium_key, prompt=f"Blocker {i}.", model=demo, max_tokens=2000, ignore_eos=True
            )
            for i in range(DEMO_SLOTS)
        ]
        deadline = time.monotonic() + 120
        while any(
            premium.get(f"/v1/jobs/{b['id']}").json()["status"] != "running" for b in blockers
        ):
            assert time.monotonic() < deadline, "the blockers did not start"
            time.sleep(0.2)
        jobs = [{"prompt": f"Basic {i}.", "max_tokens": 4, "model": demo} for i in range(BASIC)]
        response = basic.post("/v1/jobs/batch", json={"jobs": jobs})
        assert response.status_code == 202, response.text
        basic_jobs = response.json()["data"]
        time.sleep(1.0)  # the worker takes what its reserve lets it hold beside the blockers
        premium_jobs = [
            stack.submit(premium_key, prompt=f"Premium {i}.", max_tokens=4, model=demo)
            for i in range(DEMO_SLOTS)
        ]
        # The basic jobs the worker had not taken when the premium ones came (the oldest first).
        taken = BASIC - stack.redis.llen(keys.queue_name(Tier.BASIC, demo))
        assert taken < BASIC // 2, taken
        # The demo model's queues wait; the tiny model's jobs run meanwhile.
        tiny = stack.submit(basic_key, prompt="Meanwhile.", max_tokens=4)
        assert wait_final(basic, tiny["id"], timeout_s=240)["status"] == "succeeded"
        assert basic.get(f"/v1/jobs/{basic_jobs[-1]['id']}").json()["status"] == "queued"
        for blocker in blockers:
            assert premium.delete(f"/v1/jobs/{blocker['id']}").status_code == 200
        basic_done = [wait_final(basic, job["id"], timeout_s=240) for job in basic_jobs]
        premium_done = [wait_final(premium, job["id"], timeout_s=240) for job in premium_jobs]
    failed = [
        (job["tier"], job["status"], job["error"])
        for job in basic_done + premium_done
        if job["status"] != "succeeded"
    ]
    assert not failed, failed
    basic_starts = [_started(job) for job in basic_done]
    for job in premium_done:
        # Only basic jobs the worker already held go first (one more: a take racing the POSTs).
        assert sum(start < _started(job) for start in basic_starts) <= taken + 1, (taken, job)
    assert _workers_of(stack, basic_done + premium_done) == {two_models.demo_worker.name}
    # Each worker counts its starts under its model's lane: admission judges each model alone.
    started = {lane: _started_count(stack, Tier.BASIC, lane) for lane in (None, demo)}
    assert started[demo] >= BASIC and started[None] < BASIC, started


def test_an_unknown_model_is_refused_and_stores_nothing(two_models: TwoModels) -> None:
    stack = two_models.stack
    with stack.db.session() as session:
        before = session.scalar(select(func.count()).select_from(Job))
    with stack.client(stack.create_key()) as client:
        responses: list[httpx.Response] = [
            client.post("/v1/jobs", json={"prompt": "Hi.", "model": "no-such-model"}),
            client.post(
                "/v1/jobs/batch",
                json={
                    "jobs": [
                        {"prompt": "a", "model": two_models.demo},
                        {"prompt": "b", "model": "x"},
                    ]
                },
            ),
        ]
        for response in responses:
            assert response.status_code == 404, response.text
            error = response.json()["error"]
            assert error["code"] == "model_not_found"
            assert two_models.demo in error["message"] and two_models.tiny in error["message"]
    with stack.db.session() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == before
