"""The OpenAI-compatible endpoints, driven by the official openai SDK against the running stack."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from core.tiers import Tier
from tests.support import BLOCKER_TOKENS, Stack, wait_final


def _openai(stack: Stack, key: str) -> OpenAI:
    # No retries: a test must see the first answer, and a retry would submit another job.
    return OpenAI(base_url=f"{stack.api_url}/v1", api_key=key, max_retries=0, timeout=120)


def _job(stack: Stack, key: str, job_id: str) -> dict[str, Any]:
    with stack.client(key) as client:
        return wait_final(client, job_id)


def test_models_lists_the_served_model(stack: Stack) -> None:
    client = _openai(stack, stack.create_key(Tier.BASIC))
    models = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(stack.model_name, "model", "inferq")]
    assert models[0].created > 0
    assert client.models.retrieve(stack.model_name).id == stack.model_name
    # The served name, never the server's path to the model.
    assert stack.model_name == "inferq-tiny" and str(stack.model_dir) not in models[0].id


def test_completion_is_a_job_on_the_keys_tier(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    client = _openai(stack, key)
    prompt = "Once upon a time"
    completion = client.completions.create(
        model=stack.model_name,
        prompt=[prompt],
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    assert completion.object == "text_completion"
    assert completion.model == stack.model_name
    [choice] = completion.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert completion.usage is not None
    # One token per byte of the local model's tokenizer, plus BOS.
    assert completion.usage.prompt_tokens == len(prompt.encode()) + 1
    assert completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 12
    job = _job(stack, key, completion.id)
    assert job["status"] == "succeeded" and job["tier"] == "standard"
    assert job["text"] == choice.text
    assert job["sampling_params"]["max_tokens"] == 12


def test_streamed_completion_adds_up_to_the_jobs_text(stack: Stack) -> None:
    key = stack.create_key(Tier.PREMIUM)
    client = _openai(stack, key)
    stream = client.completions.create(
        model=stack.model_name,
        prompt="Stream: ü 漢字",
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert {c.object for c in chunks} == {"text_completion"}
    assert len({c.id for c in chunks}) == 1
    with_choices = [c for c in chunks if c.choices]
    reasons = [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason]
    assert reasons == ["length"]
    assert with_choices[-1].choices[0].finish_reason == "length"
    # The usage chunk comes last and carries no choices.
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 16
    text = "".join(c.choices[0].text for c in with_choices)
    job = _job(stack, key, chunks[0].id)
    assert text and text == job["text"]
    assert last.usage.prompt_tokens == job["usage"]["prompt_tokens"]


def test_chat_completion_uses_the_fallback_template(stack: Stack) -> None:
    key = stack.create_key(Tier.BASIC)
    client = _openai(stack, key)
    chat = client.chat.completions.create(
        model=stack.model_name,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi there"}]},
        ],
        max_tokens=8,
    )
    assert chat.object == "chat.completion"
    [choice] = chat.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    job = _job(stack, key, chat.id)
    assert job["tier"] == "basic" and choice.message.content == job["text"]
    # The local model has no chat template: one `Role: text` line each, then `Assistant:`.
    rendered = "System: Be brief.\nUser: Hi there\nAssistant:"
    assert chat.usage is not None and chat.usage.prompt_tokens == len(rendered) + 1


def test_streamed_chat_completion_with_usage(stack: Stack) -> None:
    key = stack.create_key(Tier.STANDARD)
    client = _openai(stack, key)
    chunks = list(
        client.chat.completions.create(
            model=stack.model_name,
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_completion_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 16
    assert usage.total_tokens == usage.prompt_tokens + 16
    assert text == _job(stack, key, chunks[0].id)["text"]


def test_bad_requests_raise_the_sdks_exceptions(stack: Stack) -> None:
    key = stack.create_key(Tier.BASIC)
    client = _openai(stack, key)
    model = stack.model_name
    with pytest.raises(openai.BadRequestError) as bad_n:
        client.completions.create(model=model, prompt="x", max_tokens=4, n=2)
    assert bad_n.value.code == "invalid_request" and bad_n.value.param == "n"
    with pytest.raises(openai.BadRequestError) as token_ids:
        client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=4)
    assert token_ids.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as over_tier:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=100_000
        )
    assert over_tier.value.code == "tier_limit_exceeded"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "x"}], max_tokens=4
        )
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError) as unauthenticated:
        _openai(stack, "iq_not-a-key").models.list()
    # OpenAI's error shape: every field there, param null when no parameter is at fault.
    assert unauthenticated.value.body == {
        "message": "Missing or invalid API key.",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
    with stack.client(key) as http:
        assert http.get("/v1/jobs").json()["data"] == []  # nothing was queued


@pytest.mark.parametrize("stream", [False, True], ids=["waiting", "streaming"])
def test_a_client_that_leaves_cancels_its_job(stack: Stack, stream: bool) -> None:
    key = stack.create_key(Tier.PREMIUM)
    body = {
        "model": stack.model_name,
        "prompt": "A long one.",
        # Long enough to outlast a busy API's late notice of the disconnect on a fast host too.
        "max_tokens": BLOCKER_TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }
    headers = {"Authorization": f"Bearer {key}"}
    # The client that leaves has a connection of its own, closed when it gives up. (On one
    # shared client, a timed-out request's socket once stayed open until the client closed,
    # after the job had ended.)
    with httpx.Client(base_url=stack.api_url, headers=headers, timeout=30) as leaving:
        if stream:
            with leaving.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                next(response.iter_lines())  # the first chunk; then the client hangs up
        else:
            with pytest.raises(httpx.ReadTimeout):
                leaving.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.5))
    with httpx.Client(base_url=stack.api_url, headers=headers, timeout=30) as http:
        deadline = time.monotonic() + 30
        while not (jobs := http.get("/v1/jobs").json()["data"]):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        job = wait_final(http, jobs[0]["id"])
    assert job["status"] == "cancelled"
    assert (job["usage"]["completion_tokens"] or 0) < BLOCKER_TOKENS
