"""Reading `Prefer: wait=N` (RFC 7240)."""

from __future__ import annotations

from api.prefer import wait_preference


def test_the_wait_preference_is_read_as_rfc_7240_writes_it() -> None:
    assert wait_preference("wait=10", 60) == 10
    assert wait_preference("respond-async, wait=5", 60) == 5
    assert wait_preference('WAIT="7"; foo=bar', 60) == 7
    assert wait_preference("wait=600", 60) == 60  # cut to the longest wait
    assert wait_preference("wait=-1", 60) is None
    assert wait_preference("wait=1.5", 60) is None  # delta-seconds are whole
    assert wait_preference("handling=lenient", 60) is None
    assert wait_preference(None, 60) is None
