"""SLA tiers: each has a queue, a scheduling priority, a deadline and a token cap."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class Tier(StrEnum):
    """The SLA tiers a key can belong to, best first."""

    PREMIUM = "premium"
    STANDARD = "standard"
    BASIC = "basic"


class TierPolicy(BaseModel):
    """What a tier promises: higher `priority` runs first; `timeout_s` bounds a job's total time.

    `max_queue_s` bounds the wait before a job starts (default: the whole `timeout_s`); a job
    still queued past it ends `timed_out` without touching the engine. A job of a lower tier
    still queued `promote_after_s` after submission moves to the front of the premium queue
    (aging), so sustained premium load cannot starve it.

    `engine_share` is the most of a worker this tier and the tiers below it may fill together:
    its slots and its KV cache. What they leave is kept for the tiers above, so a premium job
    that arrives while basic work floods the queue starts at once, without waiting for a basic
    job to end (vLLM never preempts a running request to admit a waiting one). The top tier's
    share is 1: only its own jobs count against it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    priority: int = Field(ge=0, le=100)
    timeout_s: float = Field(gt=0)
    max_tokens: int = Field(gt=0)
    max_queue_s: float | None = Field(default=None, gt=0)
    promote_after_s: float | None = Field(default=None, gt=0)
    engine_share: float = Field(default=1.0, gt=0, le=1)

    def queue_limit_s(self, timeout_s: float) -> float:
        """How long a job with total limit `timeout_s` may wait to start."""
        return min(self.max_queue_s or timeout_s, timeout_s)


# The seed's SLA levels.
DEFAULT_TIER_POLICIES: dict[Tier, TierPolicy] = {
    Tier.PREMIUM: TierPolicy(priority=10, timeout_s=30, max_tokens=2048),
    Tier.STANDARD: TierPolicy(
        priority=5, timeout_s=60, max_tokens=1024, promote_after_s=20, engine_share=0.85
    ),
    Tier.BASIC: TierPolicy(
        priority=0, timeout_s=120, max_tokens=512, promote_after_s=40, engine_share=0.7
    ),
}

# Workers consume queues in this order, so a waiting premium job is always taken first.
TIERS_BY_PRIORITY: tuple[Tier, ...] = (Tier.PREMIUM, Tier.STANDARD, Tier.BASIC)


def engine_priority(policy: TierPolicy) -> int:
    """vLLM's request priority: lower values are scheduled first, so negate the tier's."""
    return -policy.priority
