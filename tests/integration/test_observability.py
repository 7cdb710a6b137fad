"""Prometheus metrics from the API and a worker move with real jobs; Flower needs credentials."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from core.tiers import Tier
from inferq.local import free_port
from tests.otlp import OtlpReceiver
from tests.support import FLOWER_AUTH, Samples, Stack, scrape, value, wait_final


def test_metrics_move_with_real_jobs(stack: Stack) -> None:
    api_metrics = f"{stack.api_url}/metrics"
    api_before, worker_before = scrape(api_metrics), scrape(stack.worker_metrics_url)
    key = stack.create_key(Tier.BASIC)
    jobs = [
        stack.submit(key, prompt=f"Metered {i}.", max_tokens=8, ignore_eos=True) for i in range(3)
    ]
    with stack.client(key) as client:
        for job in jobs:
            assert wait_final(client, job["id"])["status"] == "succeeded"
            client.get(f"/v1/jobs/{job['id']}")
    stack.wait_idle()
    api_after, worker_after = scrape(api_metrics), scrape(stack.worker_metrics_url)

    def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    basic = {"tier": "basic"}
    # The worker: one TTFT and one queue-wait observation per job, outcomes by tier and status.
    assert moved(worker_before, worker_after, "inferq_ttft_seconds_count", **basic) == 3
    assert moved(worker_before, worker_after, "inferq_queue_wait_seconds_count", **basic) == 3
    assert moved(worker_before, worker_after, "inferq_job_tokens_per_second_count", **basic) == 3
    assert moved(worker_before, worker_after, "inferq_completion_tokens_total", **basic) == 24
    finished = {"tier": "basic", "status": "succeeded"}
    assert moved(worker_before, worker_after, "inferq_jobs_finished_total", **finished) == 3
    worker = {"worker": stack.worker_name}
    assert value(worker_after, "inferq_jobs_in_flight", **worker) == 0
    assert 0 <= value(worker_after, "inferq_engine_kv_cache_usage", **worker) <= 1
    assert ("inferq_engine_kv_cache_usage", frozenset(worker.items())) in worker_after
    memory = value(worker_after, "inferq_device_memory_used_bytes", device="cpu", **worker)
    assert memory > 100 * 2**20

    # The API: submissions by tier, queue lengths back to zero, requests by route template.
    assert moved(api_before, api_after, "inferq_jobs_submitted_total", **basic) == 3
    for tier in ("premium", "standard", "basic"):
        queue = frozenset({"tier": tier, "model": stack.model_name}.items())
        assert api_after[("inferq_queue_length", queue)] == 0  # shown, and nothing waits
    posted = {"method": "POST", "route": "/v1/jobs", "status": "202"}
    assert moved(api_before, api_after, "inferq_http_requests_total", **posted) == 3
    polled = {"method": "GET", "route": "/v1/jobs/{job_id}", "status": "200"}
    assert moved(api_before, api_after, "inferq_http_requests_total", **polled) >= 6
    label_values = {v for _, labels in api_after for _, v in labels}
    assert not any(v.startswith("job_") for v in label_values), "a job id became a label"


def test_the_worker_and_the_scheduler_answer_health_probes(stack: Stack) -> None:
    """What Kubernetes asks them (deploy/kubernetes): on their metrics ports, beside /metrics."""
    port = stack.local.env["INFERQ_SCHEDULER_METRICS_PORT"]
    for metrics in (stack.worker_metrics_url, f"http://127.0.0.1:{port}/metrics"):
        base = metrics.removesuffix("/metrics")
        for path in ("/healthz", "/readyz"):
            answer = httpx.get(f"{base}{path}", timeout=10)
            assert (answer.status_code, answer.json()) == (200, {"status": "ok"}), (base, path)
        assert "inferq_" in httpx.get(metrics, timeout=10).text


@pytest.fixture
def flower(stack: Stack) -> Iterator[str]:
    port = free_port()
    process = stack.local.start(
        "flower", [sys.executable, "-m", "inferq", "flower", "--port", str(port)]
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.HTTPError:
                assert process.poll() is None, "flower exited"
                assert time.monotonic() < deadline, "flower did not start"
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        stack.local.processes.remove(("flower", process))


def test_flower_requires_credentials_and_lists_the_worker(stack: Stack, flower: str) -> None:
    assert httpx.get(flower, timeout=10).status_code == 401
    assert httpx.get(f"{flower}/api/workers", timeout=10).status_code == 401
    wrong = httpx.get(flower, auth=("inferq-test", "wrong"), timeout=10)
    assert wrong.status_code == 401
    user, password = FLOWER_AUTH.split(":", 1)
    deadline = time.monotonic() + 60
    workers: dict[str, object] = {}
    while stack.worker_name not in workers:
        assert time.monotonic() < deadline, workers
        response = httpx.get(
            f"{flower}/api/workers", params={"refresh": "1"}, auth=(user, password), timeout=30
        )
        assert response.status_code == 200
        workers = response.json()
        time.sleep(1)


def test_one_trace_runs_from_the_api_through_the_queue_to_the_worker(
    stack: Stack, otlp: OtlpReceiver
) -> None:
    key = stack.create_key(Tier.STANDARD)
    job = stack.submit(key, prompt="Trace me.", max_tokens=4)
    with stack.client(key) as client:
        wait_final(client, job["id"])
    deadline = time.monotonic() + 30
    while True:
        spans = {s.name: s for s in otlp.spans if s.attributes.get("inferq.job_id") == job["id"]}
        if {"inferq.submit", "inferq.run_job"} <= set(spans) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {"inferq.submit", "inferq.run_job"} <= set(spans), otlp.spans[-10:]
    submit, run = spans["inferq.submit"], spans["inferq.run_job"]
    assert (submit.service, run.service) == ("inferq-api", "inferq-worker")
    assert run.trace_id == submit.trace_id
    assert run.parent_span_id == submit.span_id
    assert run.attributes["inferq.status"] == "succeeded"
