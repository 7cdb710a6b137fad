"""The direct task strategy's end of a job: its message is acknowledged whatever else fails."""

from __future__ import annotations

import pytest

from core.states import JobStatus
from workers.tasks import _ended


class BrokenSpan:
    """A tracing span whose exporter raises."""

    def set_attribute(self, *_: object) -> None:
        raise RuntimeError("the span is broken")

    def end(self) -> None:
        raise RuntimeError("the span is broken")


def test_the_message_is_acknowledged_even_when_its_span_fails() -> None:
    acks: list[str] = []
    with pytest.raises(RuntimeError):
        _ended(BrokenSpan(), lambda: acks.append("ack"), None, JobStatus.SUCCEEDED)
    assert acks == ["ack"]  # else it would hold one of the worker's slots until a reconnect
