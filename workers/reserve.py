"""Per-tier reserve: how much of the worker each tier may still take from the queues.

vLLM schedules by priority among the requests it holds, but it never preempts a running request
to admit a waiting one: a worker that fills every slot (or its whole KV cache) with basic jobs
makes a premium job wait until one of them ends, seconds on a real model. So the worker keeps
the higher tiers' share free. A tier and the tiers below it may together hold at most their
`engine_share` of the worker's slots and of its KV cache; the top tier (share 1) counts only
its own jobs, so a premium job is taken whenever one waits, and vLLM's priority scheduling
runs it ahead of everything else in the engine.

Slots are counted by message: the transport reports each message it delivers and each one
acknowledged (`taken`, `ended`), tagged with its job's tier (an aged job moved to the premium
queue counts as its own tier). A message taken before the worker's connection dropped counts
until its job ends, like the jobs its engine still runs. KV cache is counted by job: the
runner reports each job's tokens (prompt plus `max_tokens`, what it may come to hold) when it
starts and when it ends; a prefix that several jobs' prompts share (a document Q&A batch's
document, `core.prompts`) counts once while any of them runs, as it sits once in vLLM's prefix
cache. The token limit is checked against what is held when the worker
polls, so one bulk take may pass it by a few jobs; the next poll makes up for it.

With a `DeadlinePace` (`workers.pace`), a tier also takes nothing while a job of a tier above
it runs behind its deadline's pace: the batch shrinks until that job's tokens come fast enough.

A worker may take only some tiers (`inferq worker --tiers`, e.g. a pool of basic workers that
scales to zero): the others have no room on it, and the highest tier it takes counts as the top
one, since no tier above it will come to claim the share kept for it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from core.tiers import TIERS_BY_PRIORITY, Tier, TierPolicy
from workers.pace import DeadlinePace


@dataclass(frozen=True)
class EngineRun:
    """One attempt of a job in the engine, as the reserve counts it from its start to its end."""

    job_id: str
    attempt: int
    tier: Tier
    tokens: int  # the KV cache it may come to hold: its prompt plus `max_tokens`
    max_tokens: int
    timeout_s: float  # its time left when it started
    shared: tuple[str, int] | None = None  # the prefix (id, tokens) it shares with others


class TierReserve:
    """Counts what each tier holds of one worker, and what each may still take."""

    def __init__(
        self,
        policies: Mapping[Tier, TierPolicy],
        slots: int,
        kv_tokens: int | None = None,
        pace: DeadlinePace | None = None,
        tiers: Collection[Tier] = TIERS_BY_PRIORITY,
    ) -> None:
        if not tiers:
            raise ValueError("a worker takes at least one tier")
        self.slots = slots
        self.kv_tokens = kv_tokens
        self.pace = pace
        self.tiers = frozenset(tiers)
        top = next(tier for tier in TIERS_BY_PRIORITY if tier in self.tiers)
        self._shares = {
            tier: 1.0 if tier is top else policies[tier].engine_share for tier in TIERS_BY_PRIORITY
        }
        self._lock = threading.Lock()
        self._tags: dict[str, tuple[Tier, int]] = {}  # tag → its tier, deliveries not acked
        self._held = dict.fromkeys(TIERS_BY_PRIORITY, 0)
        self._tokens = dict.fromkeys(TIERS_BY_PRIORITY, 0)
        self._jobs = dict.fromkeys(TIERS_BY_PRIORITY, 0)
        # A shared prefix held: the tier its tokens count to, the tokens, the jobs holding it.
        self._prefixes: dict[str, tuple[Tier, int, int]] = {}

    def taken(self, tag: str, tier: Tier) -> None:
        """A message of `tier` was delivered to the worker.

        A message can be delivered again while the worker still runs its job (the transport
        restored it when the connection dropped): each delivery counts until it is acknowledged,
        so the skipped duplicate's ack does not free the running job's slot.
        """
        with self._lock:
            known, deliveries = self._tags.get(tag, (tier, 0))
            self._tags[tag] = (known, deliveries + 1)
            self._held[known] += 1

    def ended(self, tag: str) -> None:
        """One delivery of the message was acknowledged or rejected; unknown tags are ignored."""
        with self._lock:
            entry = self._tags.pop(tag, None)
            if entry is None:
                return
            tier, deliveries = entry
            self._held[tier] -= 1
            if deliveries > 1:
                self._tags[tag] = (tier, deliveries - 1)

    def job_started(self, run: EngineRun) -> None:
        """A job entered the engine: its KV cache counts to its tier, a shared prefix once
        however many jobs hold it, and the pace watches its deadline."""
        with self._lock:
            tokens = run.tokens
            if run.shared is not None:
                prefix, prefix_tokens = run.shared
                counted_to, _, holders = self._prefixes.get(prefix, (run.tier, prefix_tokens, 0))
                if not holders:
                    self._tokens[counted_to] += prefix_tokens
                self._prefixes[prefix] = (counted_to, prefix_tokens, holders + 1)
                tokens -= prefix_tokens
            self._tokens[run.tier] += tokens
            self._jobs[run.tier] += 1
        if self.pace is not None:
            self.pace.started(run.job_id, run.attempt, run.tier, run.max_tokens, run.timeout_s)

    def job_ended(self, run: EngineRun) -> None:
        """The run `job_started` counted left the engine."""
        with self._lock:
            tokens = run.tokens
            if run.shared is not None:
                prefix, prefix_tokens = run.shared
                counted_to, _, holders = self._prefixes.pop(prefix)
                if holders > 1:
                    self._prefixes[prefix] = (counted_to, prefix_tokens, holders - 1)
                else:
                    self._tokens[counted_to] -= prefix_tokens
                tokens -= prefix_tokens
            self._tokens[run.tier] -= tokens
            self._jobs[run.tier] -= 1
        if self.pace is not None:
            self.pace.ended(run.job_id, run.attempt)

    def left(self) -> dict[Tier, int]:
        """Messages each tier may still take now."""
        held_back = self.pace.held_back() if self.pace is not None else ()
        with self._lock:
            total = sum(self._held.values())
            rooms: dict[Tier, int] = {}
            held = tokens = jobs = 0
            # From the bottom up, so each tier's count includes the tiers below it.
            for tier in reversed(TIERS_BY_PRIORITY):
                held += self._held[tier]
                tokens += self._tokens[tier]
                jobs += self._jobs[tier]
                share = self._shares[tier]
                if tier not in self.tiers:
                    rooms[tier] = 0
                    continue
                if share >= 1:  # only its own jobs count: it may always take while one waits
                    rooms[tier] = max(self.slots - self._held[tier], 0)
                    continue
                # At least one slot: a tier whose share rounds to nothing would never run.
                room = min(max(math.floor(share * self.slots), 1) - held, self.slots - total)
                if self.kv_tokens and jobs:
                    budget = share * self.kv_tokens - tokens
                    room = min(room, math.floor(budget / (tokens / jobs)))
                rooms[tier] = 0 if tier in held_back else max(room, 0)
            return {tier: rooms[tier] for tier in TIERS_BY_PRIORITY}

    def held(self) -> dict[Tier, int]:
        """Messages held per tier."""
        with self._lock:
            return dict(self._held)

    def __json__(self) -> dict[str, int]:
        # Celery's remote control sends the transport options back as JSON (`celery inspect
        # stats`, Flower's worker page): this shows what each tier holds.
        return {tier.value: held for tier, held in self.held().items()}
