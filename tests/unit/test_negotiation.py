"""Which responses are MessagePack: the Accept header's ranking."""

from __future__ import annotations

import pytest

from api.negotiation import prefers_msgpack


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        (None, False),
        ("", False),
        ("application/json", False),
        ("*/*", False),
        ("application/x-msgpack", True),
        ("application/msgpack", True),
        ("application/vnd.msgpack", True),
        ("application/json, application/x-msgpack", True),  # a tie goes to MessagePack
        ("application/json;q=1, application/x-msgpack;q=0.5", False),
        ("application/json;q=0.5, application/x-msgpack", True),
        ("application/x-msgpack;q=0", False),
        ("application/x-msgpack;q=bogus", False),
    ],
)
def test_accept_ranking(accept: str | None, expected: bool) -> None:
    assert prefers_msgpack(accept) is expected
