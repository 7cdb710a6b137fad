"""Every Prometheus metric inferq exports, defined once; API, workers and scheduler share them.

Each process exposes the ones it moves (the API on `/metrics`, workers and the scheduler on
their metrics ports); Prometheus sums counters across processes. Labels never carry job ids.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram, Summary

from core.health import Health, serve_health

log = logging.getLogger(__name__)

# Seconds: from tens of milliseconds (a warm GPU) to the longest tier deadline.
_LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
_RATE_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)

TTFT = Histogram(
    "inferq_ttft_seconds",
    "Time from a job's submission to its first token.",
    ["tier"],
    buckets=_LATENCY_BUCKETS,
)
# A/B experiments (`core.experiments`): each variant's jobs, speed and feedback.
EXPERIMENT_JOBS = Counter(
    "inferq_experiment_jobs_total",
    "Experiment jobs that ended, by variant and status.",
    ["experiment", "variant", "status"],
)
EXPERIMENT_TTFT = Histogram(
    "inferq_experiment_ttft_seconds",
    "Time from an experiment job's submission to its first token, by variant.",
    ["experiment", "variant"],
    buckets=_LATENCY_BUCKETS,
)
EXPERIMENT_TOKENS_PER_SECOND = Histogram(
    "inferq_experiment_tokens_per_second",
    "Completion tokens per second of one experiment job, by variant.",
    ["experiment", "variant"],
    buckets=_RATE_BUCKETS,
)
EXPERIMENT_FEEDBACK = Summary(
    "inferq_experiment_feedback_score",
    "Scores clients posted for experiment jobs (sum / count: the mean), by variant.",
    ["experiment", "variant"],
)
QUEUE_WAIT = Histogram(
    "inferq_queue_wait_seconds",
    "Time from a job's submission to the start of its run.",
    ["tier"],
    buckets=_LATENCY_BUCKETS,
)
JOB_TOKENS_PER_SECOND = Histogram(
    "inferq_job_tokens_per_second",
    "Completion tokens per second of one job, first token to last.",
    ["tier"],
    buckets=_RATE_BUCKETS,
)
COMPLETION_TOKENS = Counter(
    "inferq_completion_tokens_total", "Completion tokens made by finished jobs.", ["tier"]
)
CACHED_PROMPT_TOKENS = Counter(
    "inferq_cached_prompt_tokens_total",
    "Prompt tokens served from the engine's prefix cache.",
    ["tier"],
)
JOBS_FINISHED = Counter(
    "inferq_jobs_finished_total",
    "Jobs that reached a final state, by tier and status.",
    ["tier", "status"],
)
JOBS_MERGED = Counter(
    "inferq_jobs_merged_total",
    "Jobs that shared an identical job's engine request instead of making their own.",
    ["tier"],
)
JOBS_TAKEN_IN_BULK = Counter(
    "inferq_jobs_taken_in_bulk_total",
    "Jobs a worker took beyond the first of each take (edge batching): the round trips saved.",
)
JOBS_CACHED = Counter(
    "inferq_jobs_cached_total", "Jobs answered from the result cache, without the engine.", ["tier"]
)
JOBS_SUBMITTED = Counter("inferq_jobs_submitted_total", "Jobs accepted by the API.", ["tier"])
JOBS_REQUEUED = Counter(
    "inferq_jobs_requeued_total", "Jobs put back in the queue after their worker was lost."
)
QUEUE_LENGTH = Gauge(
    "inferq_queue_length",
    "Jobs waiting in each tier's queue of each model (read at scrape time).",
    ["tier", "model"],
)
IN_FLIGHT = Gauge("inferq_jobs_in_flight", "Jobs running in this worker's engine.", ["worker"])
KV_CACHE_USAGE = Gauge(
    "inferq_engine_kv_cache_usage", "Fraction of the engine's KV cache in use.", ["worker"]
)
TIME_PER_TOKEN = Gauge(
    "inferq_engine_time_per_token_seconds",
    "Seconds between a running request's output tokens in the worker's engine (smoothed).",
    ["worker"],
)
HELD_FOR_PACE = Gauge(
    "inferq_tier_held_for_pace",
    "1 while the tier takes no new jobs on the worker because a job of a tier above it runs "
    "too slowly for its deadline (deadline pacing).",
    ["worker", "tier"],
)
HOLDS_FOR_PACE = Counter(
    "inferq_tier_holds_for_pace_total",
    "Times the tier began to take no new jobs on the worker because a job of a tier above it "
    "fell behind its deadline's pace.",
    ["worker", "tier"],
)
ENGINE_WAITING = Gauge(
    "inferq_engine_waiting_requests",
    "Requests the engine has accepted but not yet scheduled.",
    ["worker"],
)
DEVICE_MEMORY = Gauge(
    "inferq_device_memory_used_bytes",
    "Memory used on each device: GPU memory (NVML) or, on CPU, the worker's resident memory.",
    ["worker", "device"],
)
HTTP_REQUESTS = Counter(
    "inferq_http_requests_total", "HTTP requests by route template.", ["method", "route", "status"]
)
HTTP_LATENCY = Histogram(
    "inferq_http_request_duration_seconds",
    "Time to answer an HTTP request (to the start of a streamed body).",
    ["method", "route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60),
)


def count_submitted(tiers: Iterable[str]) -> None:
    """Count accepted jobs by tier."""
    for tier in tiers:
        JOBS_SUBMITTED.labels(tier).inc()


def serve_metrics(port: int, health: Health, address: str = "0.0.0.0") -> None:
    """Expose this process's metrics on their own HTTP port (0: not at all), with `health`'s
    `/healthz` and `/readyz` on the same port (see `core.health`)."""
    if not port:
        return
    try:
        serve_health(port, health, address)
    except OSError as exc:
        raise RuntimeError(
            f"cannot serve metrics on port {port} ({exc.strerror}): give each process on this "
            "host its own port (worker: --metrics-port; INFERQ_*_METRICS_PORT; 0 turns it off)"
        ) from exc
    log.info("metrics on :%d/metrics", port)
