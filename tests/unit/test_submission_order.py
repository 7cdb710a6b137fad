"""A batch's repeats are enqueued right after their first, so the worker merges them."""

from __future__ import annotations

from api.submission import _repeats_together
from core.models import Job


def test_each_repeat_follows_its_first_and_the_rest_keep_their_order() -> None:
    keys = ["a", "b", None, "a", "c", "b", None, "a"]
    waiting = [(Job(id=f"job{i}", cache_key=key), f"route{i}") for i, key in enumerate(keys)]
    ordered = _repeats_together(waiting)
    assert [job.id for job, _ in ordered] == [
        "job0", "job3", "job7", "job1", "job5", "job2", "job4", "job6"
    ]  # fmt: skip
    assert all(route == f"route{job.id[3:]}" for job, route in ordered)
