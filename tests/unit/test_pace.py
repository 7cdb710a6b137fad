"""Deadline pace: a job whose tokens come too slowly for its deadline holds the tiers below it."""

from __future__ import annotations

import time

import pytest

from core.tiers import DEFAULT_TIER_POLICIES, Tier
from workers.generation import Delta
from workers.pace import DeadlinePace
from workers.reserve import EngineRun, TierReserve


def _steps(pace: DeadlinePace, job_ids: list[str], start: float, per_token: float, n: int) -> None:
    """`n` engine steps of one token for each job, `per_token` seconds apart."""
    for step in range(n):
        at = start + step * per_token
        pace.observe([Delta(job_id, 1, "x", 1, at) for job_id in job_ids])


def test_a_premium_job_too_slow_for_its_deadline_holds_the_lower_tiers_back() -> None:
    pace = DeadlinePace()
    reserve = TierReserve(DEFAULT_TIER_POLICIES, slots=100, pace=pace)
    now = time.time()
    # The reserve tells the pace of each run it counts.
    premium = EngineRun("premium", 1, Tier.PREMIUM, tokens=600, max_tokens=500, timeout_s=30)
    reserve.job_started(premium)
    reserve.job_started(EngineRun("basic", 1, Tier.BASIC, 200, max_tokens=100, timeout_s=120))
    # 0.03 s a token: 490 tokens left need 14.7 s of the 29.7 s left. On pace.
    _steps(pace, ["premium", "basic"], now, 0.03, 10)
    assert pace.behind(now=now + 0.3) is None
    assert reserve.left()[Tier.BASIC] == 70

    # The batch grew and a token now takes 0.1 s: 480 tokens need 48 s. Behind.
    _steps(pace, ["premium", "basic"], now + 0.4, 0.1, 10)
    per_token = pace.time_per_token()
    assert per_token is not None and per_token > 0.08
    assert pace.behind(now=now + 1.4) == Tier.PREMIUM
    left = reserve.left()
    assert left[Tier.BASIC] == 0 and left[Tier.STANDARD] == 0
    assert left[Tier.PREMIUM] == 100  # the tier itself is never held back

    # Its run ended: nothing is behind, and the lower tiers take work again.
    reserve.job_ended(premium)
    assert pace.behind(now=now + 1.5) is None


def test_a_standard_job_behind_holds_basic_only_and_a_job_past_its_deadline_holds_nobody() -> None:
    holds: list[Tier] = []
    pace = DeadlinePace(on_hold=holds.append)
    now = time.time()
    pace.started("standard", 1, Tier.STANDARD, max_tokens=1000, timeout_s=10)
    _steps(pace, ["standard"], now, 0.05, 5)  # 995 tokens at 0.05 s: 50 s, with 10 s left
    assert pace.behind(now=now + 1) == Tier.STANDARD
    assert pace.behind(now=now + 2) == Tier.STANDARD
    assert holds == [Tier.BASIC]  # counted once, as the hold began
    reserve = TierReserve(DEFAULT_TIER_POLICIES, slots=100, pace=pace)
    left = reserve.left()
    assert left[Tier.BASIC] == 0 and left[Tier.STANDARD] == 85
    assert pace.behind(now=now + 11) is None  # it will time out; waiting helps nobody
    pace.started("premium", 1, Tier.PREMIUM, max_tokens=1000, timeout_s=30)
    _steps(pace, ["premium"], now + 1, 0.05, 5)
    assert pace.behind(now=now + 2) == Tier.PREMIUM  # a new hold, of standard and basic
    assert holds == [Tier.BASIC, Tier.STANDARD, Tier.BASIC]


def test_the_first_delta_of_a_job_is_not_a_decode_pace_and_unknown_jobs_are_ignored() -> None:
    pace = DeadlinePace()
    deadline = time.time() + 30
    pace.started("a", 1, Tier.PREMIUM, max_tokens=10, timeout_s=30)
    pace.observe([Delta("a", 1, "x", 1, 100.0), Delta("other", 1, "y", 1, 100.0)])
    assert pace.time_per_token() is None  # the first token's wait was the queue and the prompt
    pace.observe([Delta("a", 1, "x", 2, 100.1), Delta("a", 2, "x", 1, 100.1)])
    assert pace.time_per_token() == pytest.approx(0.05)
    pace.ended("a", 2)  # another attempt: this one still counts
    # 7 tokens left at 0.05 s: 0.35 s; behind once less than 0.35 / 0.8 s is left.
    assert pace.behind(now=deadline - 1) is None
    assert pace.behind(now=deadline - 0.35) == Tier.PREMIUM


def test_a_job_that_cannot_make_its_deadline_even_at_the_best_pace_holds_nobody_back() -> None:
    pace = DeadlinePace()
    now = time.time()
    pace.started("warm-up", 1, Tier.BASIC, max_tokens=100, timeout_s=120)
    _steps(pace, ["warm-up"], now - 5, 0.01, 80)  # a nearly empty engine: 0.01 s a token
    assert pace.best_time_per_token() == pytest.approx(0.01)
    pace.started("hopeless", 1, Tier.PREMIUM, max_tokens=5000, timeout_s=30)
    pace.started("feasible", 1, Tier.STANDARD, max_tokens=500, timeout_s=30)
    _steps(pace, ["warm-up", "hopeless", "feasible"], now, 0.1, 30)  # the batch grew
    # 5,000 tokens would take 50 s even at 0.01 s: holding the others back cannot save it. The
    # standard job's 470 tokens take 4.7 s at best, 47 s now: it holds basic back.
    assert pace.behind(now=now + 3) == Tier.STANDARD
