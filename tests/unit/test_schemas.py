"""Request validation and the list cursor, without services."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from api.schemas import JobCreate, decode_cursor, encode_cursor
from core.errors import InvalidRequest
from core.models import Job


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"prompt": ""},
        {"prompt": 1},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "max_tokens": "3"},
        {"prompt": "x", "max_tokens": 2.0},
        {"prompt": "x", "max_tokens": True},
        {"prompt": "x", "temperature": 3},
        {"prompt": "x", "top_p": 0},
        {"prompt": "x", "stop": 3},
        {"prompt": "x", "tier": "premium"},
        {"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user"}]},
    ],
)
def test_invalid_bodies_are_rejected(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        JobCreate.model_validate(body)


def test_a_job_is_a_prompt_or_a_conversation() -> None:
    plain = JobCreate.model_validate({"prompt": "Once upon"})
    chat = JobCreate.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ]
        }
    )
    assert (plain.message_dicts(), plain.text_length()) == ([], 9)
    assert chat.message_dicts()[1] == {"role": "user", "content": "Hi"}
    assert chat.prompt is None and chat.text_length() == len("Be brief.Hi")


def test_sampling_params_drop_unset_values() -> None:
    body = JobCreate.model_validate({"prompt": "x", "temperature": 0, "stop": ["\n"]})
    assert body.sampling_params(16) == {
        "max_tokens": 16,
        "temperature": 0,
        "top_p": 1.0,
        "stop": ["\n"],
    }


def test_cursor_round_trips_and_rejects_garbage() -> None:
    job = Job(id="job_abc", created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    assert decode_cursor(encode_cursor(job)) == (job.created_at, "job_abc")
    with pytest.raises(InvalidRequest):
        decode_cursor("not-a-cursor")
