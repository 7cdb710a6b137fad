"""A worker's Prometheus side: its metrics port, what it observes about jobs, device memory,
and the counters its heartbeat publishes to Redis (`WorkerStats`).

The engine's own figures (KV-cache use, waiting requests) come from a vLLM stat logger in
`workers.engine`; everything here works without importing vLLM.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from core.jobs import JobOutcome
from core.metrics import (
    CACHED_PROMPT_TOKENS,
    COMPLETION_TOKENS,
    DEVICE_MEMORY,
    EXPERIMENT_JOBS,
    EXPERIMENT_TOKENS_PER_SECOND,
    EXPERIMENT_TTFT,
    JOB_TOKENS_PER_SECOND,
    JOBS_FINISHED,
    QUEUE_WAIT,
    TTFT,
)
from core.models import as_utc
from core.states import JobStatus

log = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    """Counters a worker keeps about itself; published to Redis by its heartbeat."""

    in_flight: int = 0
    peak_in_flight: int = 0
    engine_requests: int = 0
    merged: int = 0
    skipped: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_mapping(self) -> dict[str | bytes | bytearray | memoryview | int | float, int]:
        """The counters, as written to the worker's stats hash."""
        with self.lock:
            return {
                "in_flight": self.in_flight,
                "peak_in_flight": self.peak_in_flight,
                "engine_requests": self.engine_requests,
                "merged": self.merged,
                "skipped": self.skipped,
            }


def observe_start(tier: str, created_at: datetime, started_at: datetime) -> None:
    """A job left the queue."""
    QUEUE_WAIT.labels(tier).observe(
        max(0.0, (as_utc(started_at) - as_utc(created_at)).total_seconds())
    )


def observe_outcome(
    tier: str,
    created_at: datetime,
    outcome: JobOutcome,
    finished_at: datetime,
    arm: tuple[str, str] | None = None,
) -> None:
    """A run ended and its outcome was stored; `arm`: its experiment and variant, if any."""
    JOBS_FINISHED.labels(tier, outcome.status.value).inc()
    COMPLETION_TOKENS.labels(tier).inc(outcome.completion_tokens)
    if arm is not None:
        EXPERIMENT_JOBS.labels(*arm, outcome.status.value).inc()
    if outcome.cached_prompt_tokens:
        CACHED_PROMPT_TOKENS.labels(tier).inc(outcome.cached_prompt_tokens)
    if outcome.first_token_at is None:
        return
    first = as_utc(outcome.first_token_at)
    ttft_s = max(0.0, (first - as_utc(created_at)).total_seconds())
    TTFT.labels(tier).observe(ttft_s)
    if arm is not None:
        EXPERIMENT_TTFT.labels(*arm).observe(ttft_s)
    generating_s = (as_utc(finished_at) - first).total_seconds()
    if outcome.completion_tokens > 1 and generating_s > 0:
        rate = (outcome.completion_tokens - 1) / generating_s
        JOB_TOKENS_PER_SECOND.labels(tier).observe(rate)
        if arm is not None:
            EXPERIMENT_TOKENS_PER_SECOND.labels(*arm).observe(rate)


def observe_ended_unrun(tier: str, status: JobStatus) -> None:
    """A job ended without reaching the engine (cancelled or expired while queued)."""
    JOBS_FINISHED.labels(tier, status.value).inc()


CHILDREN_EVERY = 60
"""Samples between two look-ups of the worker's child processes (a minute at one a second)."""


class DeviceMemory:
    """Samples memory in use on the worker's devices: NVML for GPUs, resident memory on CPU."""

    def __init__(self, worker: str, gpus: tuple[int, ...]) -> None:
        self.worker = worker
        self.gpus = gpus
        self._nvml: Any = None
        self._children: list[Any] = []
        self._samples = 0
        if gpus:
            try:
                import pynvml  # nvidia-ml-py, installed with vLLM's GPU build

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception:
                log.warning("NVML unavailable: GPU memory is not reported", exc_info=True)

    def sample(self) -> None:
        """Update the device-memory gauges."""
        if self._nvml is not None:
            for index in self.gpus:  # NVML counts physical devices, as --gpus does
                handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
                used = self._nvml.nvmlDeviceGetMemoryInfo(handle).used
                DEVICE_MEMORY.labels(self.worker, f"gpu{index}").set(used)
        elif not self.gpus:
            import psutil

            process = psutil.Process()
            rss = process.memory_info().rss
            # Finding the children walks every process of the host (most of a sample's CPU);
            # the engine's processes are started once, so they are looked up again only
            # every `CHILDREN_EVERY` samples or when one has gone.
            if self._samples % CHILDREN_EVERY == 0:
                self._children = process.children(recursive=True)  # the engine core runs apart
            self._samples += 1
            for child in self._children:
                try:
                    rss += child.memory_info().rss
                except psutil.Error:
                    self._samples = 0
            DEVICE_MEMORY.labels(self.worker, "cpu").set(rss)
