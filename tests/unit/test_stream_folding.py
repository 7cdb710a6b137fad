"""How a reader folds a job's events into its text when runs are lost and resumed."""

from __future__ import annotations

from typing import Any

from core.events import streamed_text


def _running(seq: int, attempt: int, **fields: Any) -> dict[str, Any]:
    return {"seq": seq, "type": "status", "status": "running", "attempt": attempt, **fields}


def _delta(seq: int, attempt: int, text: str) -> dict[str, Any]:
    return {"seq": seq, "type": "delta", "attempt": attempt, "text": text, "tokens": len(text)}


def _queued(seq: int, attempt: int) -> dict[str, Any]:
    return {"seq": seq, "type": "status", "status": "queued", "attempt": attempt}


def test_one_run_is_its_deltas_in_order() -> None:
    events = [_running(1, 1), _delta(2, 1, "Hel"), _delta(3, 1, "lo")]
    assert streamed_text(events) == ("Hello", 5)


def test_a_run_that_starts_afresh_voids_the_lost_runs_text() -> None:
    events = [_running(1, 1), _delta(2, 1, "Lost"), _queued(3, 1), _running(4, 2)]
    assert streamed_text([*events, _delta(5, 2, "New")]) == ("New", 3)


def test_a_resumed_run_continues_the_text_it_read() -> None:
    events = [
        _running(1, 1),
        _delta(2, 1, "Once "),
        _delta(3, 1, "upon"),
        _queued(4, 1),
        _running(5, 2, resumes_after=4),
        _delta(6, 2, " a time"),
    ]
    assert streamed_text(events) == ("Once upon a time", 16)


def test_a_lost_runs_late_deltas_are_void_for_the_resumed_run() -> None:
    """A stalled worker may publish after the next run read the stream: not part of the text."""
    events = [
        _running(1, 1),
        _delta(2, 1, "Kept"),
        _queued(3, 1),
        _delta(4, 1, " stale"),  # after what the next run read
        _running(5, 2, resumes_after=3),
        _delta(6, 2, " new"),
        _delta(7, 1, " staler"),
    ]
    assert streamed_text(events) == ("Kept new", 8)


def test_a_run_resumed_twice_keeps_both_earlier_runs_text() -> None:
    events = [
        _running(1, 1),
        _delta(2, 1, "ab"),
        _queued(3, 1),
        _running(4, 2, resumes_after=3),
        _delta(5, 2, "cd"),
        _queued(6, 2),
        _running(7, 3, resumes_after=6),
        _delta(8, 3, "ef"),
    ]
    assert streamed_text(events) == ("abcdef", 6)
