"""Pure logic of token streams: merging queued deltas and reading Last-Event-ID."""

from __future__ import annotations

import pytest

from api.streaming import parse_last_event_id
from core.errors import InvalidRequest
from workers.generation import Delta
from workers.streams import merge_deltas


def test_merging_keeps_each_attempts_text_in_order_and_its_first_timestamp() -> None:
    deltas = [
        Delta("a", 1, "Hel", 1, at=1.0),
        Delta("b", 1, "x", 1, at=1.0),
        Delta("a", 1, "lo", 2, at=2.0),
        Delta("a", 2, "new", 1, at=3.0),
        Delta("b", 1, "", 1, at=4.0),
        Delta("c", 1, "", 0, at=5.0),
    ]
    merged = merge_deltas(deltas)
    assert [(d.job_id, d.attempt, d.text, d.tokens, d.at) for d in merged] == [
        ("a", 1, "Hello", 3, 1.0),
        ("b", 1, "x", 2, 1.0),
        ("a", 2, "new", 1, 3.0),
    ]
    assert deltas[0].text == "Hel"  # the inputs are left as they were


def test_merging_never_splits_a_multibyte_character_differently() -> None:
    text = "ü漢字😀"
    pieces = [Delta("a", 1, ch, 1) for ch in text]
    assert merge_deltas(pieces)[0].text.encode() == text.encode()


@pytest.mark.parametrize(("raw", "seq"), [(None, 0), ("", 0), ("0", 0), ("17", 17), (" 5 ", 5)])
def test_last_event_id_is_a_sequence_number(raw: str | None, seq: int) -> None:
    assert parse_last_event_id(raw) == seq


@pytest.mark.parametrize("raw", ["abc", "-1", "1.5", "0x10", "٣", "9" * 19])
def test_a_malformed_last_event_id_is_rejected_naming_the_header(raw: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        parse_last_event_id(raw)
    assert error.value.param == "Last-Event-ID"
