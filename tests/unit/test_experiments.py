"""A/B experiments: stable assignment by user, shares that follow the weights, the figures."""

from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError

from core.experiments import Estimate, Experiment, JobFigures, summarize
from core.settings import Settings

TONE = {"variants": {"control": {"weight": 90}, "adapter": {"weight": 10, "model": "tone"}}}


def test_a_user_always_gets_the_same_variant_and_shares_follow_the_weights() -> None:
    experiment = Experiment.model_validate(TONE)
    first = [experiment.assign("tone", f"user-{i}") for i in range(10_000)]
    assert first == [experiment.assign("tone", f"user-{i}") for i in range(10_000)]
    shares = Counter(first)
    assert abs(shares["adapter"] / 10_000 - 0.10) < 0.01
    # Another experiment over the same users draws them independently of this one.
    other = [experiment.assign("other", f"user-{i}") for i in range(10_000)]
    assert sum(a != b for a, b in zip(first, other, strict=True)) > 1000
    assert experiment.variants["adapter"].overrides() == {"model": "tone"}


def test_experiments_come_from_the_settings_and_need_two_variants(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("INFERQ_EXPERIMENTS", '{"tone": ' + str(TONE).replace("'", '"') + "}")
    assert list(Settings().experiments["tone"].variants) == ["control", "adapter"]
    with pytest.raises(ValidationError, match="at least two variants"):
        Experiment.model_validate({"variants": {"only": {"weight": 1}}})
    with pytest.raises(ValidationError):
        Experiment.model_validate({"variants": {"a": {"weight": 0}, "b": {"weight": 1}}})


def test_the_error_rate_interval_stays_inside_zero_and_one() -> None:
    none_failed = Estimate.proportion(0, 50)
    assert none_failed.mean == 0 and none_failed.low == 0 and 0 < (none_failed.high or 0) < 0.1
    half = Estimate.proportion(50, 100)
    assert half.low is not None and half.high is not None
    assert 0.39 < half.low < 0.5 < half.high < 0.61
    assert Estimate.proportion(0, 0).mean is None


def test_a_report_sums_each_variant_up_in_the_experiments_order() -> None:
    jobs = [
        JobFigures("b", True, 0.2, 100.0, 1.0),
        JobFigures("b", False, None, None, None),
        JobFigures("a", True, 0.1, 50.0, 0.0),
        JobFigures("a", True, 0.3, 70.0, None),
    ]
    a, b = summarize(jobs, {"a": 1, "b": 2}, ["a", "b"])
    assert (a.variant, a.jobs, a.users, b.jobs, b.users) == ("a", 2, 1, 2, 2)
    assert a.error_rate.mean == 0 and b.error_rate.mean == 0.5
    assert a.ttft_s.mean == pytest.approx(0.2) and a.ttft_s.low is not None
    assert b.ttft_s.n == 1 and b.ttft_s.low is None  # one value: no interval
    assert a.tokens_per_s.mean == pytest.approx(60.0) and a.feedback.n == 1
