"""Freezing a serving process's start-up heap out of the cycle collector's reach."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from core.heap import freeze_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # leave the test process as it was


class _Thing:
    """Instances of a class are always tracked (a dict of strings is not)."""


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


@pytest.mark.usefixtures("unfrozen")
def test_objects_alive_at_the_freeze_are_out_of_reach_and_later_ones_are_not() -> None:
    before = _Thing()
    assert _tracked(before)

    frozen = freeze_heap()

    # Frozen objects can still die (another thread's, meanwhile), so the count only falls.
    assert 0 < gc.get_freeze_count() <= frozen
    assert not _tracked(before)  # full collections no longer walk it
    after = _Thing()
    assert _tracked(after)
    # Garbage made after the freeze is still collected.
    cycle: list[object] = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1
