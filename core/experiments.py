"""A/B experiments: a job sent to an experiment runs as one of its variants.

An experiment (`INFERQ_EXPERIMENTS`) names variants, each a weight and what it changes in the
job: its model (the served one or a LoRA adapter, `core.adapters`) and sampling settings. A job
that names the experiment gets a variant chosen from a stable key, the request's `user` or else
the key's owner, hashed with the experiment's name: one user always sees the same variant, and
the shares follow the weights over many users. The job records its experiment and variant; the
workers count each variant's jobs, errors, time to first token and tokens, and clients may post
a score for a job (`POST /v1/jobs/{id}/feedback`). `inferq experiments report NAME` sums it up
with confidence intervals (`summarize`).
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import func, select

from core.db import Database
from core.models import Job, as_utc
from core.states import FINAL_STATES, JobStatus

Z_95 = 1.959964
"""The normal quantile of a two-sided 95% interval."""


class Variant(BaseModel):
    """One arm of an experiment: its weight and what it sets in the job (unset: the job's own)."""

    model_config = ConfigDict(extra="forbid")

    weight: int = Field(gt=0, description="Its share of users is weight / the weights' sum.")
    model: str | None = Field(default=None, description="The served model or an adapter.")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, gt=0)

    def overrides(self) -> dict[str, object]:
        """The job fields this variant sets."""
        return self.model_dump(exclude={"weight"}, exclude_none=True)


class Experiment(BaseModel):
    """Variants by name, in the order their shares are laid out."""

    model_config = ConfigDict(extra="forbid")

    variants: dict[str, Variant]

    @field_validator("variants")
    @classmethod
    def _two_or_more(cls, variants: dict[str, Variant]) -> dict[str, Variant]:
        if len(variants) < 2:
            raise ValueError("an experiment needs at least two variants")
        return variants

    def assign(self, name: str, key: str) -> str:
        """The variant for `key` in the experiment called `name`: the same for the same key."""
        digest = hashlib.sha256(f"{name}\0{key}".encode()).digest()
        point = int.from_bytes(digest[:8], "big") % sum(v.weight for v in self.variants.values())
        for variant_name, variant in self.variants.items():
            if point < variant.weight:
                return variant_name
            point -= variant.weight
        raise AssertionError("unreachable: the point lies below the weights' sum")


@dataclass(frozen=True)
class Estimate:
    """A mean and its 95% confidence interval (None where there is nothing to estimate)."""

    mean: float | None
    low: float | None
    high: float | None
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Estimate:
        """The mean of `values`, with a normal-approximation interval."""
        if not values:
            return cls(None, None, None, 0)
        mean = statistics.fmean(values)
        if len(values) < 2:
            return cls(mean, None, None, 1)
        half = Z_95 * statistics.stdev(values) / math.sqrt(len(values))
        return cls(mean, mean - half, mean + half, len(values))

    @classmethod
    def proportion(cls, hits: int, n: int) -> Estimate:
        """A rate with its Wilson score interval (sound near 0 and 1, where errors sit)."""
        if n == 0:
            return cls(None, None, None, 0)
        p = hits / n
        z2 = Z_95 * Z_95
        centre = (p + z2 / (2 * n)) / (1 + z2 / n)
        half = Z_95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
        return cls(p, max(centre - half, 0.0), min(centre + half, 1.0), n)


@dataclass(frozen=True)
class JobFigures:
    """What a report reads of one ended job of the experiment."""

    variant: str
    succeeded: bool
    ttft_s: float | None
    tokens_per_s: float | None
    feedback: float | None


@dataclass(frozen=True)
class VariantReport:
    """One variant's figures."""

    variant: str
    jobs: int
    users: int
    error_rate: Estimate
    ttft_s: Estimate
    tokens_per_s: Estimate
    feedback: Estimate


def summarize(
    jobs: Iterable[JobFigures], users: dict[str, int], variants: Iterable[str]
) -> list[VariantReport]:
    """Each variant's report, in the experiment's order; `users`: distinct users per variant."""
    by_variant: dict[str, list[JobFigures]] = {name: [] for name in variants}
    for job in jobs:
        by_variant.setdefault(job.variant, []).append(job)
    return [
        VariantReport(
            variant=name,
            jobs=len(ended),
            users=users.get(name, 0),
            error_rate=Estimate.proportion(sum(not j.succeeded for j in ended), len(ended)),
            ttft_s=Estimate.of([j.ttft_s for j in ended if j.ttft_s is not None]),
            tokens_per_s=Estimate.of([j.tokens_per_s for j in ended if j.tokens_per_s is not None]),
            feedback=Estimate.of([j.feedback for j in ended if j.feedback is not None]),
        )
        for name, ended in by_variant.items()
    ]


def report(db: Database, name: str, variants: Iterable[str] = ()) -> list[VariantReport]:
    """The experiment's ended jobs, summed up per variant (`variants` first, in their order)."""
    final = [status.value for status in FINAL_STATES]
    user = func.coalesce(Job.end_user, Job.owner)
    with db.session() as session:
        rows = session.execute(
            select(
                Job.variant,
                Job.status,
                Job.created_at,
                Job.first_token_at,
                Job.finished_at,
                Job.completion_tokens,
                Job.feedback_score,
            ).where(Job.experiment == name, Job.status.in_(final))
        ).all()
        users = {
            str(variant): count
            for variant, count in session.execute(
                select(Job.variant, func.count(func.distinct(user)))
                .where(Job.experiment == name, Job.status.in_(final))
                .group_by(Job.variant)
            )
        }
    return summarize([_figures(row) for row in rows], users, variants)


def _figures(row: Any) -> JobFigures:
    variant, status, created, first, finished, tokens, feedback = row
    ttft_s = rate = None
    if first is not None:
        ttft_s = max((as_utc(first) - as_utc(created)).total_seconds(), 0.0)
        generating_s = (as_utc(finished) - as_utc(first)).total_seconds() if finished else 0.0
        if tokens and tokens > 1 and generating_s > 0:
            rate = (tokens - 1) / generating_s
    return JobFigures(variant, status == JobStatus.SUCCEEDED.value, ttft_s, rate, feedback)
