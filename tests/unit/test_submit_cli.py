"""`inferq submit`'s pure parts: the request it sends, the events it reads, what it prints."""

from __future__ import annotations

import io

import click
import pytest

from inferq.client import sse_events
from inferq.submit import AnswerPrinter, request_body


def test_a_question_goes_through_the_chat_template_unless_raw() -> None:
    chat = request_body("Hi?", system="Be brief.", raw=False, max_tokens=None, temperature=0)
    assert chat == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi?"},
        ],
        "temperature": 0,
    }
    raw = request_body("Once", system=None, raw=True, max_tokens=8, temperature=0.7)
    assert raw == {"prompt": "Once", "max_tokens": 8, "temperature": 0.7}
    with pytest.raises(click.UsageError):
        request_body("x", system="s", raw=True, max_tokens=None, temperature=0)


def test_sse_events_are_parsed_and_comments_skipped() -> None:
    lines = [": keep-alive", "", "id: 1", "event: status", 'data: {"seq": 1, "type": "status"}', ""]
    lines += ["id: 2", "event: delta", 'data: {"seq": 2, "type": "delta", "text": "Hi"}', ""]
    assert [e["seq"] for e in sse_events(iter(lines))] == [1, 2]


def _job(text: str) -> dict[str, object]:
    return {"id": "job_1", "status": "succeeded", "text": text, "usage": {"completion_tokens": 3}}


def test_the_answer_alone_goes_to_stdout_as_it_streams() -> None:
    out, err = io.StringIO(), io.StringIO()
    printer = AnswerPrinter(out, err)
    printer.event({"type": "status", "job_id": "job_1", "status": "running", "attempt": 1})
    printer.event({"type": "delta", "job_id": "job_1", "text": "The capital "})
    assert out.getvalue() == "The capital "  # written as it came
    printer.event({"type": "delta", "job_id": "job_1", "text": "is Tokyo"})
    printer.finish(_job("The capital is Tokyo."))  # the stream missed the last piece
    assert out.getvalue() == "The capital is Tokyo.\n"
    assert "job_1 succeeded" in err.getvalue()


def test_a_run_started_again_after_a_lost_worker_restarts_the_text() -> None:
    out, err = io.StringIO(), io.StringIO()
    printer = AnswerPrinter(out, err)
    printer.event({"type": "delta", "job_id": "job_1", "text": "Half an"})
    printer.event({"type": "status", "job_id": "job_1", "status": "running", "attempt": 2})
    printer.event({"type": "delta", "job_id": "job_1", "text": "A whole answer."})
    printer.finish(_job("A whole answer."))
    assert out.getvalue().splitlines()[-1] == "A whole answer."
    assert "started again" in err.getvalue()
