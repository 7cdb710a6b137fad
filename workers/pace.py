"""Deadline pace: the tiers below a job that falls behind its deadline take no new work.

Continuous batching shares every engine step among all the requests running, so the time per
output token grows with the batch. vLLM's priority scheduling orders admission and preempts
only when the KV cache runs out: it does not keep a premium request's tokens coming fast enough
while basic requests fill the batch. A premium job of 512 tokens due in 30 s needs a token
every 58 ms, however many basic jobs run beside it.

So the worker watches the pace. Every engine step's deltas give the time per token (smoothed
over the steps of all running requests: each request gets one token a step), and each running
job's tokens left (its `max_tokens` less what it made) and time left (to its deadline). A job
is behind when its tokens left, at the current time per token, would take more than `MARGIN`
of its time left. While a job of some tier is behind, the tiers below it take no new jobs from
the queues (`workers.reserve`): the batch shrinks as their running jobs end, and every step gets
faster. Nothing running is stopped, and a tier's own jobs are never held back for one of its
own. A job that cannot make its deadline even at the best pace this engine has shown (the
lowest smoothed time per token, a nearly empty batch's) holds nobody back, nor does one past
its deadline: waiting would help no one.

The count is of `max_tokens`, the most a job may make: a job that would stop sooner at its end
of text is paced as if it would not (the safe side: the deadline holds either way).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from core.tiers import TIERS_BY_PRIORITY, Tier
from workers.generation import Delta, DeltaSink

MARGIN = 0.9
"""A job is behind when its tokens left need more than this share of its time left."""
SMOOTHING = 0.1
"""Weight of each new time-per-token sample in the running average."""
FLOOR_AFTER_SAMPLES = 50
"""The best pace is read only once this many samples have smoothed the average."""
RECHECK_S = 0.05
"""How long an answer of `behind` is reused: the reserve asks on every poll of the queues."""


@dataclass
class _Paced:
    tier: Tier
    tokens_left: int
    deadline: float  # Unix time
    last_at: float | None = None  # when its last delta arrived


class DeadlinePace:
    """Tracks the running jobs' pace against their deadlines; see the module docstring."""

    def __init__(
        self, margin: float = MARGIN, on_hold: Callable[[Tier], None] | None = None
    ) -> None:
        """`on_hold` is called with each tier as it begins to be held back."""
        self.margin = margin
        self.on_hold = on_hold
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, int], _Paced] = {}  # by (job id, attempt)
        self._time_per_token: float | None = None
        self._best: float | None = None  # the lowest `_time_per_token` once smoothed
        self._samples = 0
        self._behind: Tier | None = None
        self._checked_at = float("-inf")

    def started(
        self, job_id: str, attempt: int, tier: Tier, max_tokens: int, timeout_s: float
    ) -> None:
        """An attempt of a job entered the engine, to make `max_tokens` within `timeout_s`."""
        with self._lock:
            self._jobs[job_id, attempt] = _Paced(tier, max_tokens, time.time() + timeout_s)

    def ended(self, job_id: str, attempt: int) -> None:
        """The attempt left the engine; unknown ones are ignored."""
        with self._lock:
            self._jobs.pop((job_id, attempt), None)

    def observe(self, deltas: list[Delta]) -> None:
        """One engine step's deltas (a `DeltaSink`): tokens made, and the time they took."""
        with self._lock:
            for delta in deltas:
                job = self._jobs.get((delta.job_id, delta.attempt))
                if job is None or not delta.tokens:
                    continue
                job.tokens_left -= delta.tokens
                # The first delta's wait includes the queue and the prompt: not a decode pace.
                if job.last_at is not None and delta.at > job.last_at:
                    sample = (delta.at - job.last_at) / delta.tokens
                    average = self._time_per_token
                    average = (
                        sample if average is None else average + SMOOTHING * (sample - average)
                    )
                    self._time_per_token = average
                    self._samples += 1
                    if self._samples >= FLOOR_AFTER_SAMPLES:
                        self._best = average if self._best is None else min(self._best, average)
                job.last_at = delta.at

    def watching(self, sink: DeltaSink) -> DeltaSink:
        """`sink`, with every step's deltas observed here first."""

        def observed(deltas: list[Delta]) -> None:
            self.observe(deltas)
            sink(deltas)

        return observed

    def time_per_token(self) -> float | None:
        """The engine's current seconds per output token of a request (None: not measured)."""
        with self._lock:
            return self._time_per_token

    def best_time_per_token(self) -> float | None:
        """The lowest smoothed time per token seen (None: not enough samples yet)."""
        with self._lock:
            return self._best

    def held_back(self) -> tuple[Tier, ...]:
        """The tiers that take no new jobs now: those below the highest tier behind."""
        return _below(self.behind())

    def behind(self, now: float | None = None) -> Tier | None:
        """The highest tier with a running job behind its deadline's pace (None: none is)."""
        clock = time.monotonic()
        with self._lock:
            if now is None and clock - self._checked_at < RECHECK_S:
                return self._behind
            per_token, best = self._time_per_token, self._best or 0.0
            at = time.time() if now is None else now
            late = (
                [
                    job.tier
                    for job in self._jobs.values()
                    if job.tokens_left * best
                    <= job.deadline - at
                    < job.tokens_left * per_token / self.margin
                ]
                if per_token is not None
                else []
            )
            behind = min(late, key=TIERS_BY_PRIORITY.index, default=None)
            was_held = set(_below(self._behind))
            self._behind, self._checked_at = behind, clock
        if self.on_hold is not None:
            for tier in _below(behind):
                if tier not in was_held:
                    self.on_hold(tier)
        return behind


def _below(tier: Tier | None) -> tuple[Tier, ...]:
    """The tiers below `tier` (none below None)."""
    return TIERS_BY_PRIORITY[TIERS_BY_PRIORITY.index(tier) + 1 :] if tier else ()
