"""The OpenAI-compatible protocol without services: requests to jobs, prompts, chunks, errors."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError
from tokenizers import Tokenizer

from api.errors import install_error_handlers
from api.openai.chat_prompt import render_chat, render_fallback
from api.openai.protocol import (
    ChatCompletionRequest,
    ChunkFormat,
    CompletionRequest,
    check_model,
    job_failure,
)
from api.openai.serving import StreamDiverged, StreamedText
from core.errors import AuthenticationFailed, InvalidRequest, ModelNotFound
from core.modelinfo import ModelInfo
from core.states import JobStatus
from workers.tiny_model import build_tokenizer_json


def _completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hello", **fields})


def test_completion_becomes_an_ordinary_job_body() -> None:
    job = _completion(
        prompt=["Hello"], max_tokens=8, temperature=0, stop=["\n"], seed=3, n=1, user="u"
    ).to_job()
    assert job.prompt == "Hello"
    assert job.sampling_params(8) == {
        "max_tokens": 8,
        "temperature": 0,
        "top_p": 1.0,
        "stop": ["\n"],
        "seed": 3,
    }


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"prompt": [1, 2]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [[1]]}, "prompt"),
        ({"prompt": ""}, "prompt"),  # JobCreate's own rule
        ({"temperature": 3}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logprobs": 2}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 3}, "best_of"),
    ],
)
def test_unsupported_or_invalid_completions_are_400(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        _completion(**fields).to_job()
    assert error.value.param == param and error.value.message


def test_neutral_values_of_unsupported_fields_are_accepted() -> None:
    _completion(frequency_penalty=0.0, presence_penalty=0, logprobs=None, echo=False).to_job()
    chat = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": False,
            "response_format": {"type": "text"},
        }
    )
    chat.to_job("x")


def test_unknown_fields_and_roles_are_rejected() -> None:
    with pytest.raises(ValidationError):
        _completion(priority=100)
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "tool", "content": "x"}]}
        )
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": []})


def test_chat_takes_text_parts_and_max_completion_tokens() -> None:
    chat = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}],
                },
            ],
            "max_tokens": 50,
            "max_completion_tokens": 5,
        }
    )
    messages = chat.message_dicts()
    assert messages[1] == {"role": "user", "content": "Hi you"}
    assert render_fallback(messages) == "System: Be brief.\nUser: Hi you\nAssistant:"
    assert chat.to_job("p").max_tokens == 5
    image = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    )
    with pytest.raises(InvalidRequest) as error:
        image.message_dicts()
    assert error.value.param == "messages[0].content"


def _model(chat_template: str | None) -> ModelInfo:
    return ModelInfo(
        name="m",
        max_model_len=64,
        tokenizer=Tokenizer.from_str(build_tokenizer_json()),
        chat_template=chat_template,
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
    )


CHATML = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
STRICT = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] | tojson }}"
    "{% endfor %}"
)


def test_chat_template_is_used_when_the_model_has_one() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    # The tokenizer adds BOS itself, so the template's own BOS is dropped.
    assert render_chat(_model(CHATML), messages) == "<|user|>Hi</s>\n<|assistant|>"
    assert render_chat(_model(None), messages) == "User: Hi\nAssistant:"
    assert render_chat(_model(STRICT), [{"role": "user", "content": "é"}]) == '"é"'
    with pytest.raises(InvalidRequest, match="System role not supported"):
        render_chat(_model(STRICT), [{"role": "system", "content": "x"}])
    # A template that does not compile falls back rather than failing every request.
    assert render_chat(_model("{% for %}"), messages) == "User: Hi\nAssistant:"


def test_streamed_text_survives_a_rerun_that_repeats_itself() -> None:
    text = StreamedText()

    def feed(kind: str, attempt: int, chunk: str = "") -> str:
        fields = {"text": chunk} if kind == "delta" else {"status": "running"}
        return text.feed({"type": kind, "attempt": attempt, **fields})

    assert feed("status", 1) == ""
    assert feed("delta", 1, "Hello") == "Hello"
    assert feed("delta", 1, " wor") == " wor"
    assert feed("status", 2) == ""  # the worker was lost: attempt 2 starts over
    assert feed("delta", 2, "Hel") == ""
    assert feed("delta", 1, "ld") == ""  # a late delta of the void attempt
    assert feed("delta", 2, "lo world") == "ld"
    assert feed("delta", 2, "!") == "!"
    assert text.sent == "Hello world!"
    assert feed("status", 3) == ""
    with pytest.raises(StreamDiverged):
        feed("delta", 3, "Goodbye")


def test_a_cached_job_streams_its_one_delta() -> None:
    assert StreamedText().feed({"type": "delta", "attempt": 0, "text": "all"}) == "all"


def _frame(frame: str) -> dict[str, Any]:
    assert frame.startswith("data: ") and frame.endswith("\n\n")
    payload: dict[str, Any] = json.loads(frame[len("data: ") :])
    return payload


def test_chunks_have_openais_shapes() -> None:
    chat = ChunkFormat("chat.completion", "job_1", 7, "m", include_usage=True)
    opening = _frame(chat.opening() or "")
    assert opening["object"] == "chat.completion.chunk" and opening["usage"] is None
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert _frame(chat.text("hi"))["choices"][0]["delta"] == {"content": "hi"}
    finish = _frame(chat.finish("length"))["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "length"
    usage = _frame(chat.usage(3, 4))
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    text = ChunkFormat("text_completion", "job_1", 7, "m", include_usage=False)
    assert text.opening() is None
    chunk = _frame(text.text("hi"))
    assert chunk["object"] == "text_completion" and "usage" not in chunk
    assert chunk["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]
    assert _frame(text.finish("abort"))["choices"][0]["finish_reason"] == "stop"


def test_jobs_that_did_not_succeed_become_openai_errors() -> None:
    failed = job_failure("job_1", JobStatus.FAILED, "engine_error", "boom")
    assert failed.status_code == 500 and failed.retry
    assert failed.body == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": "engine_error"}
    }
    timed_out = job_failure("job_1", JobStatus.TIMED_OUT, "queue_timeout", None)
    assert timed_out.status_code == 504 and timed_out.body["error"]["code"] == "queue_timeout"
    cancelled = job_failure("job_1", JobStatus.CANCELLED, None, None)
    assert cancelled.status_code == 409 and not cancelled.retry
    assert cancelled.body["error"]["code"] == "job_cancelled"


def test_errors_on_openai_paths_always_carry_param() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/v1/models")
    async def models() -> None:
        raise AuthenticationFailed()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> None:
        check_model("served", model_id)

    @app.get("/v1/jobs")
    async def jobs() -> None:
        raise AuthenticationFailed()

    client = TestClient(app)
    assert client.get("/v1/models").json() == {
        "error": {
            "type": "authentication_error",
            "code": "invalid_api_key",
            "message": "Missing or invalid API key.",
            "param": None,
        }
    }
    missing = client.get("/v1/models/other/model")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == ModelNotFound.code
    assert missing.json()["error"]["param"] == "model"
    assert "param" not in client.get("/v1/jobs").json()["error"]  # the rest is unchanged
