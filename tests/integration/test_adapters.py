"""LoRA adapters: registered while the system runs, selected per job, changing only the jobs
that name them — on the same worker, through every surface, with nothing stored for a model
nobody serves."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from core.adapters import AdapterStore
from core.models import Job
from core.tiers import Tier
from tests.otlp import OtlpReceiver
from tests.stacks import stack_of_its_own
from tests.support import Stack, wait_final
from workers.tiny_model import init_tiny_adapter

PROMPT = "The adapter test: once upon a time"
GREEDY = {"temperature": 0.0, "max_tokens": 24}


@pytest.fixture(scope="module")
def lora_stack(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, otlp: OtlpReceiver
) -> Iterator[Stack]:
    """A stack whose worker serves adapters, on a Redis and a SQLite database of its own."""
    tmp = tmp_path_factory.mktemp("lora")
    with stack_of_its_own(tmp, model_dir, otlp.url, env={"INFERQ_LORA": "true"}) as stack:
        yield stack


def _cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inferq", "adapters", *args],
        env=stack.local.env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _job_count(stack: Stack) -> int:
    with stack.db.session() as session:
        return session.scalar(select(func.count()).select_from(Job)) or 0


def _texts(client: httpx.Client, jobs: list[dict[str, Any]]) -> list[str]:
    finals = [wait_final(client, job["id"]) for job in jobs]
    assert [job["status"] for job in finals] == ["succeeded"] * len(jobs), finals
    return [job["text"] for job in finals]


def test_an_adapter_registered_at_run_time_changes_only_the_jobs_that_name_it(
    lora_stack: Stack, tmp_path: Path
) -> None:
    stack = lora_stack
    served = stack.model_name
    added = _cli(stack, "add", "storyteller", str(init_tiny_adapter(tmp_path / "storyteller")))
    assert added.returncode == 0, added.stderr
    key = stack.create_key(Tier.PREMIUM)
    with stack.client(key) as client:
        models = client.get("/v1/models").json()["data"]
        # Each with the workers that serve it: here the stack's one, which loads adapters.
        assert [(m["id"], m.get("parent"), m["workers"]) for m in models] == [
            (served, None, [stack.worker_name]),
            ("storyteller", served, [stack.worker_name]),
        ]
        assert client.get("/v1/models/storyteller").json()["parent"] == served

        # Submitted together, so they share the worker's engine batches.
        jobs = [
            stack.submit(key, prompt=PROMPT, **GREEDY),
            stack.submit(key, prompt=PROMPT, model="storyteller", **GREEDY),
            stack.submit(key, prompt=PROMPT, model=served, cache=False, **GREEDY),
        ]
        base, adapted, base_named = _texts(client, jobs)
        assert adapted != base
        assert base_named == base
        assert [wait_final(client, job["id"])["model"] for job in jobs] == [
            served,
            "storyteller",
            served,
        ]

        # Repeats come from the result cache, each from its own model's entry.
        repeats = [
            stack.submit(key, prompt=PROMPT, **GREEDY),
            stack.submit(key, prompt=PROMPT, model="storyteller", **GREEDY),
        ]
        assert _texts(client, repeats) == [base, adapted]

        # The OpenAI surface names it as `model` too, and answers with its name.
        completion = client.post(
            "/v1/completions",
            json={"model": "storyteller", "prompt": PROMPT, **GREEDY},
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["model"] == "storyteller"
        assert completion.json()["choices"][0]["text"] == adapted


def test_a_model_nobody_serves_is_refused_on_every_surface_and_stores_nothing(
    lora_stack: Stack, tmp_path: Path
) -> None:
    stack = lora_stack
    adapter = init_tiny_adapter(tmp_path / "retired")
    assert _cli(stack, "add", "retired", str(adapter)).returncode == 0
    removed = _cli(stack, "remove", "retired")
    assert removed.returncode == 0, removed.stderr
    key = stack.create_key(Tier.STANDARD)
    before = _job_count(stack)
    with stack.client(key) as client:
        assert "retired" not in [m["id"] for m in client.get("/v1/models").json()["data"]]
        refused = [
            client.post("/v1/jobs", json={"prompt": PROMPT, "model": "retired"}),
            client.post(
                "/v1/jobs/batch", json={"jobs": [{"prompt": "a"}, {"prompt": "b", "model": "nope"}]}
            ),
            client.post("/v1/completions", json={"model": "retired", "prompt": PROMPT}),
            client.post(
                "/v1/chat/completions",
                json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
            ),
            client.post(
                "/v1/qa-batches",
                json={"document": "A short document.", "questions": ["Why?"], "model": "nope"},
            ),
            client.get("/v1/models/retired"),
        ]
        for response in refused:
            assert response.status_code == 404, response.text
            assert response.json()["error"]["code"] == "model_not_found", response.text
    assert _job_count(stack) == before

    # Registered again, the name is a new adapter to the engines.
    again = AdapterStore(stack.db).add("retired", adapter)
    assert again.id > 0
    assert [a.name for a in AdapterStore(stack.db).all()].count("retired") == 1


def test_without_lora_a_job_naming_an_adapter_is_refused_and_stores_nothing(
    stack: Stack, tmp_path: Path
) -> None:
    """The default stack serves no adapters: even a registered one is not a model there."""
    store = AdapterStore(stack.db)
    store.add(f"off-{tmp_path.name}"[:60], init_tiny_adapter(tmp_path / "adapter"))
    key = stack.create_key(Tier.STANDARD)
    before = _job_count(stack)
    with stack.client(key) as client:
        models = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == [stack.model_name]
        assert stack.worker_name in models[0]["workers"]
        response = client.post("/v1/jobs", json={"prompt": PROMPT, "model": store.all()[-1].name})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and "INFERQ_LORA is off" in error["message"]
    assert _job_count(stack) == before
