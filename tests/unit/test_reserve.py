"""The per-tier reserve: what each tier may still take from the queues into one worker."""

from __future__ import annotations

from core import keys
from core.tiers import DEFAULT_TIER_POLICIES, Tier
from workers.reserve import EngineRun, TierReserve


def _run(tokens: int, shared: tuple[str, int] | None = None) -> EngineRun:
    return EngineRun("job", 1, Tier.BASIC, tokens, max_tokens=100, timeout_s=120, shared=shared)


def _fill(reserve: TierReserve, tier: Tier, count: int, start: int = 0) -> None:
    for index in range(start, start + count):
        reserve.taken(f"{tier.value}-{index}", tier)


def test_basic_work_leaves_the_tiers_above_their_share_of_the_slots() -> None:
    reserve = TierReserve(DEFAULT_TIER_POLICIES, slots=100)
    _fill(reserve, Tier.BASIC, 70)  # basic's share: 70 of 100 slots

    left = reserve.left()
    assert left[Tier.BASIC] == 0
    assert left[Tier.STANDARD] == 15  # standard and basic together: 85
    assert left[Tier.PREMIUM] == 100  # premium counts only its own jobs

    _fill(reserve, Tier.STANDARD, 15)
    assert reserve.left()[Tier.STANDARD] == 0
    _fill(reserve, Tier.PREMIUM, 20)
    assert reserve.left() == {Tier.PREMIUM: 80, Tier.STANDARD: 0, Tier.BASIC: 0}


def test_a_full_worker_takes_only_premium_jobs_and_slots_free_as_messages_are_acked() -> None:
    reserve = TierReserve(DEFAULT_TIER_POLICIES, slots=10)
    _fill(reserve, Tier.PREMIUM, 10)
    assert reserve.left() == {Tier.PREMIUM: 0, Tier.STANDARD: 0, Tier.BASIC: 0}

    reserve.ended("premium-0")
    reserve.ended("premium-0")  # an ack seen twice frees one slot
    reserve.ended("unknown")
    assert reserve.left() == {Tier.PREMIUM: 1, Tier.STANDARD: 1, Tier.BASIC: 1}
    # A message restored after a lost connection comes again while its job still runs: the
    # duplicate is skipped and acked, and the running job keeps its slot until its own ack.
    reserve.taken("premium-1", Tier.PREMIUM)
    assert reserve.left()[Tier.PREMIUM] == 0
    reserve.ended("premium-1")
    assert reserve.left()[Tier.PREMIUM] == 1
    reserve.ended("premium-1")
    assert reserve.left()[Tier.PREMIUM] == 2


def test_a_tier_whose_share_rounds_to_nothing_still_gets_a_slot() -> None:
    reserve = TierReserve(DEFAULT_TIER_POLICIES, slots=1)
    assert reserve.left() == {Tier.PREMIUM: 1, Tier.STANDARD: 1, Tier.BASIC: 1}


def test_lower_tiers_keep_within_their_share_of_the_kv_cache() -> None:
    reserve = TierReserve(DEFAULT_TIER_POLICIES, slots=100, kv_tokens=10_000)
    for _ in range(6):
        reserve.job_started(_run(1_000))  # 6,000 of basic's 7,000 tokens
    _fill(reserve, Tier.BASIC, 6)

    left = reserve.left()
    assert left[Tier.BASIC] == 1  # room for one more job of the size it holds
    assert left[Tier.STANDARD] == 2
    reserve.job_started(_run(1_000))
    assert reserve.left()[Tier.BASIC] == 0

    reserve.job_ended(_run(1_000))
    assert reserve.left()[Tier.BASIC] == 1


def test_a_prefix_that_jobs_share_counts_once_while_any_of_them_runs() -> None:
    reserve = TierReserve(DEFAULT_TIER_POLICIES, slots=100, kv_tokens=10_000)
    document = ("prefix-id", 1_500)
    for _ in range(20):  # 1,500 shared + 20 x 100 own = 3,500 of basic's 7,000 tokens
        reserve.job_started(_run(1_600, document))
    _fill(reserve, Tier.BASIC, 20)
    assert reserve.left()[Tier.BASIC] == 20  # 3,500 tokens left, 175 per job held

    for _ in range(19):
        reserve.job_ended(_run(1_600, document))
    assert reserve.left()[Tier.BASIC] == 3  # one job, still holding the document: 1,600 tokens
    reserve.job_ended(_run(1_600, document))
    reserve.job_started(_run(1_000))
    assert reserve.left()[Tier.BASIC] == 6  # the document's tokens went with its last job


def test_the_tier_of_a_queue_is_read_from_its_name() -> None:
    assert keys.tier_of_queue(keys.queue_name(Tier.BASIC)) is Tier.BASIC
    assert keys.tier_of_queue(keys.worker_queue_name(Tier.PREMIUM, "cpu.2@host")) is Tier.PREMIUM
    assert keys.tier_of_queue("celery") is None
    assert keys.tier_of_queue("inferq.other") is None


def test_a_worker_that_takes_some_tiers_has_no_room_for_the_others() -> None:
    """Only basic jobs (`inferq worker --tiers basic`): no share is kept for tiers above."""
    reserve = TierReserve(DEFAULT_TIER_POLICIES, slots=10, tiers=[Tier.BASIC])
    assert reserve.left() == {Tier.PREMIUM: 0, Tier.STANDARD: 0, Tier.BASIC: 10}
    _fill(reserve, Tier.BASIC, 10)
    assert reserve.left()[Tier.BASIC] == 0

    # Standard is the top tier here: it takes whenever one waits, as premium does elsewhere.
    both = TierReserve(DEFAULT_TIER_POLICIES, slots=10, tiers=[Tier.STANDARD, Tier.BASIC])
    _fill(both, Tier.BASIC, 7)
    assert both.left() == {Tier.PREMIUM: 0, Tier.STANDARD: 10, Tier.BASIC: 0}
