"""Answers a person can check, from the demo model that a fresh `inferq up` made."""

from __future__ import annotations

import time
from typing import Any

import httpx
from openai import OpenAI

from tests.realmodel.conftest import DemoStack, template_token_count
from tests.support import wait_final

JAPAN = "What is the capital of Japan?"
DOCUMENT = (
    "Zorblax Industries is a small company that makes ceramic valves. It was founded in 1987 "
    "by Ida Kroon in the town of Vellmar. Today it has 140 employees."
)
"""Facts no model knows: an answer that holds them came from the document."""


def _client(stack: DemoStack) -> httpx.Client:
    return httpx.Client(
        base_url=stack.api_url, headers={"Authorization": f"Bearer {stack.key}"}, timeout=120
    )


def test_up_prints_a_short_summary_with_the_served_model(demo_stack: DemoStack) -> None:
    banner = demo_stack.banner
    assert "inferq is up." in banner and "smollm2-135m-instruct" in banner
    assert not [line for line in banner.splitlines() if line.lstrip().startswith("{")], banner
    assert "alembic" not in banner.lower()
    assert len(banner.splitlines()) <= 25, banner
    assert (demo_stack.model_dir / "inferq-model.json").is_file()


def test_submit_prints_the_answer_and_nothing_else_on_stdout(demo_stack: DemoStack) -> None:
    asked = demo_stack.inferq("submit", JAPAN, "--api-url", demo_stack.api_url)
    assert asked.returncode == 0, asked.stderr
    assert "Tokyo" in asked.stdout
    assert len(asked.stdout.strip().splitlines()) == 1, asked.stdout
    assert "succeeded" in asked.stderr and '"level"' not in asked.stderr  # no JSON log lines


def test_a_chat_completion_through_the_openai_sdk_answers_tokyo(demo_stack: DemoStack) -> None:
    client = OpenAI(base_url=f"{demo_stack.api_url}/v1", api_key=demo_stack.key)
    assert [m.id for m in client.models.list()] == ["smollm2-135m-instruct"]
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": JAPAN}],
        temperature=0,
        max_tokens=32,
    )
    assert "Tokyo" in (reply.choices[0].message.content or "")


def test_the_chat_template_is_applied_to_messages(demo_stack: DemoStack) -> None:
    messages = [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": JAPAN},
    ]
    expected = template_token_count(demo_stack.model_dir, messages)
    client = OpenAI(base_url=f"{demo_stack.api_url}/v1", api_key=demo_stack.key)
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=messages,
        temperature=0,
        max_tokens=16,  # type: ignore[arg-type]
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == expected
    with _client(demo_stack) as http:
        job = http.post(
            "/v1/jobs", json={"messages": messages, "temperature": 0, "max_tokens": 16}
        ).json()
        done = wait_final(http, job["id"])
    assert done["status"] == "succeeded", done
    assert done["usage"]["prompt_tokens"] == expected
    assert done["model"] == "smollm2-135m-instruct"


def test_document_qa_answers_come_from_the_document(demo_stack: DemoStack) -> None:
    questions = {
        "When was Zorblax Industries founded?": "1987",
        "Who founded Zorblax Industries?": "Kroon",
        "How many employees does Zorblax Industries have?": "140",
    }
    with _client(demo_stack) as http:
        created = http.post(
            "/v1/qa-batches",
            json={"document": DOCUMENT, "questions": list(questions), "max_tokens": 48},
        )
        assert created.status_code == 202, created.text
        for answer in _wait_batch(http, created.json()["id"]):
            assert answer["status"] == "succeeded", answer
            assert questions[answer["question"]] in answer["answer"], answer


def _wait_batch(http: httpx.Client, batch_id: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        batch = http.get(f"/v1/qa-batches/{batch_id}").json()
        if batch["status"] == "completed":
            return list(batch["answers"])
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} did not complete")


def test_merged_identical_requests_return_the_same_sensible_text(demo_stack: DemoStack) -> None:
    job = {"messages": [{"role": "user", "content": JAPAN}], "temperature": 0, "max_tokens": 32}
    with _client(demo_stack) as http:
        # Not from the result cache: all eight are in flight at once, and merged.
        jobs = http.post("/v1/jobs/batch", json={"jobs": [{**job, "cache": False}] * 8}).json()
        done = [wait_final(http, j["id"]) for j in jobs["data"]]
    assert {d["status"] for d in done} == {"succeeded"}
    assert len({d["text"] for d in done}) == 1 and "Tokyo" in done[0]["text"]
    assert "merged" in {d["served_from"] for d in done}


def test_flower_lists_the_jobs_of_a_local_run(demo_stack: DemoStack) -> None:
    with _client(demo_stack) as http:
        job = http.post("/v1/jobs", json={"prompt": "Flower", "max_tokens": 4}).json()
        wait_final(http, job["id"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        tasks = httpx.get(
            f"{demo_stack.flower_url}/api/tasks", auth=demo_stack.flower_auth, timeout=10
        ).json()
        if any(job["id"] in str(task.get("args")) for task in tasks.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"Flower never listed {job['id']}: {tasks}")
