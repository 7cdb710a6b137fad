"""The SLA benchmark's workload: an open-loop arrival trace of mixed tiers, and the tier limits.

Arrivals are a Poisson process (exponential gaps) at a level's rate; each request draws its tier
(20% premium, 30% standard, 50% basic), a prompt length (log-uniform between a few hundred and
about 1,500 tokens) and an output length (log-uniform between a sixteenth of its tier's token
cap and the cap), both times `scale`. Every draw comes from a generator seeded with the run's
seed and the level, so the same seed, level, rate and scale give the same trace; prompts are
random common words cut to their length with the model's own tokenizer, distinct from each
other so no prompt reuses another's cached prefix.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from core.settings import Settings
from core.tiers import Tier

TIER_SHARES: dict[str, float] = {"premium": 0.2, "standard": 0.3, "basic": 0.5}
TIERS: tuple[str, ...] = tuple(TIER_SHARES)
PROMPT_TOKENS = (200, 1500)
"""Prompt lengths before `scale`: log-uniform between these."""
OUTPUT_FLOOR = 1 / 16
"""The shortest output, as a share of its tier's token cap (before `scale`)."""
TIME_FIELDS = ("timeout_s", "max_queue_s", "promote_after_s")
"""The tier policy's durations: `deadline_scale` scales them all, so the policy keeps its shape."""
_WORD_TEXT = (
    "the of and to in is was that for on as with by at from his her are this be which an or "
    "had not but what all were when we there can been has more if will one would about their "
    "out into them some time could these two may first then do any like my now over such our "
    "man me even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never day same "
    "another know while last might us great old year off come since against go came right used "
    "take three house report market water river garden engine number question answer letter"
)
_WORDS = _WORD_TEXT.split()


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives (seconds after the level starts), its tier,
    its prompt and how many tokens it asks for."""

    index: int
    at_s: float
    tier: str
    prompt: str
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Trace:
    """The requests of one load level, in arrival order."""

    level: float
    rate: float
    """Arrivals per second."""
    duration_s: float
    requests: list[TraceRequest]

    def summary(self) -> dict[str, Any]:
        """JSON-ready facts of the trace (not its prompts)."""
        by_tier = {tier: [r for r in self.requests if r.tier == tier] for tier in TIERS}
        return {
            "level": self.level,
            "rate_per_s": round(self.rate, 4),
            "duration_s": self.duration_s,
            "requests": len(self.requests),
            "requests_by_tier": {tier: len(reqs) for tier, reqs in by_tier.items()},
            "prompt_tokens_mean": _mean([r.prompt_tokens for r in self.requests]),
            "max_tokens_mean": _mean([r.max_tokens for r in self.requests]),
        }


def _mean(values: list[int]) -> float:
    return round(sum(values) / len(values), 1) if values else 0.0


class TraceMaker:
    """Makes the traces of one run from its seed, the tiers' token caps and `scale`."""

    def __init__(self, model_dir: Path, caps: dict[str, int], scale: float, seed: int) -> None:
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.caps = caps
        self.scale = scale
        self.seed = seed

    def _rng(self, label: str) -> random.Random:
        # A string seed is hashed with SHA-512: the same on every run and Python build.
        return random.Random(f"inferq-sla/{self.seed}/{label}")

    def _draw(self, rng: random.Random) -> tuple[str, int, int]:
        """A tier, a prompt length and an output length."""
        tier = rng.choices(TIERS, weights=[TIER_SHARES[t] for t in TIERS])[0]
        prompt = max(8, round(_log_uniform(rng, *PROMPT_TOKENS) * self.scale))
        cap = self.caps[tier]
        output = max(1, round(_log_uniform(rng, cap * OUTPUT_FLOOR, cap) * self.scale))
        return tier, prompt, output

    def _prompts(self, rng: random.Random, lengths: list[int]) -> list[str]:
        """Distinct prompts of these lengths in the model's tokens (random words, cut)."""
        # Words are at least one token each in any tokenizer, so `n` words make `n` tokens.
        texts = [" ".join(rng.choices(_WORDS, k=n)) for n in lengths]
        encoded = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [self._tokenizer.decode(e.ids[:n]) for e, n in zip(encoded, lengths, strict=True)]

    def _requests(self, rng: random.Random, times: list[float]) -> list[TraceRequest]:
        draws = [self._draw(rng) for _ in times]
        prompts = self._prompts(rng, [prompt for _, prompt, _ in draws])
        return [
            TraceRequest(i, at, tier, text, prompt, output)
            for i, (at, (tier, prompt, output), text) in enumerate(
                zip(times, draws, prompts, strict=True)
            )
        ]

    def level(self, level: float, rate: float, duration_s: float) -> Trace:
        """Poisson arrivals at `rate` per second for `duration_s` seconds."""
        rng = self._rng(f"level {level:g}")
        times: list[float] = []
        at = rng.expovariate(rate)
        while at < duration_s:
            times.append(at)
            at += rng.expovariate(rate)
        return Trace(level, rate, duration_s, self._requests(rng, times))

    def calibration(self, batch: int = 256) -> Iterator[TraceRequest]:
        """Endless requests drawn as a trace's are, for the closed-loop calibration (made
        `batch` at a time, as they are taken)."""
        rng = self._rng("calibration")
        while True:
            yield from self._requests(rng, [0.0] * batch)

    def mean_output_tokens(self, samples: int = 20_000) -> float:
        """The mean output length of a trace's requests (from a large fixed sample)."""
        rng = self._rng("mean output")
        return sum(self._draw(rng)[2] for _ in range(samples)) / samples


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def token_caps(settings: Settings) -> dict[str, int]:
    """Each tier's max_tokens cap."""
    return {tier: settings.tier_policy(Tier(tier)).max_tokens for tier in TIERS}


def tier_limits(settings: Settings, deadline_scale: float) -> dict[str, float]:
    """Each tier's time limit in seconds: its policy's timeout times `deadline_scale`."""
    return {tier: settings.tier_policy(Tier(tier)).timeout_s * deadline_scale for tier in TIERS}


def scaled_tier_table(settings: Settings, deadline_scale: float) -> dict[str, dict[str, float]]:
    """The tier table (as `INFERQ_TIERS` takes it) with every duration times `deadline_scale`,
    so inferq enforces the same limits the benchmark applies to the other systems."""
    table: dict[str, dict[str, float]] = {}
    for tier in TIERS:
        policy = settings.tier_policy(Tier(tier)).model_dump()
        table[tier] = {
            name: policy[name] * deadline_scale
            for name in TIME_FIELDS
            if policy.get(name) is not None
        }
    return table
