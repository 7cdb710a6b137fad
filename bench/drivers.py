"""The benchmarks' drivers: the same jobs sent to inferq's API, to vLLM's own server, and
straight into the engine in this process.

Each sends every job at once, as that many users would, and times each until its answer is in.
The HTTP clients use aiohttp rather than httpx: on a 2-core host httpx's per-request CPU cost
took more of the machine than the servers being measured.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any

import aiohttp
from report import ModeResult, percentile

from core.settings import Settings

FINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled", "timed_out"})
CONNECTIONS = 64
"""Connections the submissions to inferq share (each long poll has one of its own)."""
LONG_POLL_S = 30
JOB_DEADLINE_S = 600.0


@dataclass(frozen=True)
class Workload:
    """The jobs both modes run: distinct prompts, each making exactly `max_tokens` tokens."""

    jobs: int
    max_tokens: int
    temperature: float = 1.0

    def prompts(self, run: int = 0) -> list[str]:
        """One distinct prompt per job, and per run (no run reuses another's cached prefix)."""
        return [
            f"Run {run}, question {i}: what is {i} times {i % 7 + 3}, and why? Answer in one line."
            for i in range(self.jobs)
        ]

    def sampling(self) -> dict[str, Any]:
        """Sampling parameters as the API stores them for a job of this workload."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "ignore_eos": True}


async def _submit(
    session: aiohttp.ClientSession, prompt: str, workload: Workload, wait_s: int | None = None
) -> dict[str, Any]:
    body = {"prompt": prompt, **workload.sampling()}
    headers = {"Prefer": f"wait={wait_s}"} if wait_s else None
    async with session.post("/v1/jobs", json=body, headers=headers) as response:
        if response.status not in (200, 202):
            raise RuntimeError(f"POST /v1/jobs answered {response.status}: {await response.text()}")
        job: dict[str, Any] = await response.json()
    return job


async def _wait_final(
    session: aiohttp.ClientSession, job: dict[str, Any]
) -> tuple[dict[str, Any], float]:
    """The job once final (long-polled unless it already is), and when the client saw it so."""
    deadline = time.perf_counter() + JOB_DEADLINE_S
    while job["status"] not in FINAL_STATUSES:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"job {job['id']} was not final after {JOB_DEADLINE_S:g} s")
        async with session.get(f"/v1/jobs/{job['id']}", params={"wait": LONG_POLL_S}) as response:
            response.raise_for_status()
            job = await response.json()
    return job, time.perf_counter()


async def _submit_and_wait(
    submit: aiohttp.ClientSession,
    poll: aiohttp.ClientSession,
    prompt: str,
    workload: Workload,
    wait_s: int | None,
) -> tuple[dict[str, Any], float, float]:
    """What one user does: submit, then long-poll until final; returns (job, posted, final).

    With `wait_s`, the submission itself asks to wait for the end (`Prefer: wait`), and the
    job usually comes back final: one request instead of two.
    """
    job = await _submit(submit, prompt, workload, wait_s)
    posted = time.perf_counter()
    final, done = await _wait_final(poll, job)
    return final, posted, done


async def _submit_batch_and_wait(
    submit: aiohttp.ClientSession,
    poll: aiohttp.ClientSession,
    prompts: list[str],
    workload: Workload,
    wait_s: int | None,
) -> list[tuple[dict[str, Any], float, float]]:
    """Submit several jobs in one `POST /v1/jobs/batch`, then long-poll each until final
    (with `wait_s`, only those the batch's answer did not bring back final)."""
    body = {"jobs": [{"prompt": p, **workload.sampling()} for p in prompts]}
    headers = {"Prefer": f"wait={wait_s}"} if wait_s else None
    async with submit.post("/v1/jobs/batch", json=body, headers=headers) as response:
        if response.status not in (200, 202):
            detail = await response.text()
            raise RuntimeError(f"POST /v1/jobs/batch answered {response.status}: {detail}")
        jobs = (await response.json())["data"]
    posted = time.perf_counter()
    finals = await asyncio.gather(*(_wait_final(poll, job) for job in jobs))
    return [(job, posted, done) for job, done in finals]


async def drive_pipeline(
    api_url: str,
    key: str,
    workload: Workload,
    batch_size: int | None = None,
    run: int = 0,
    prefer_wait: bool = True,
) -> ModeResult:
    """One warm-up job, then every job submitted concurrently, each waited for until final.

    With `prefer_wait`, each submission asks to be answered once its jobs have ended
    (`Prefer: wait=30`) and holds a connection of its own meanwhile, as each user would; without
    it, submissions share `CONNECTIONS` connections and each job is then long-polled on a
    connection of its own. With `batch_size`, jobs go in `POST /v1/jobs/batch` requests of that
    many, sent concurrently.
    """
    wait_s = LONG_POLL_S if prefer_wait else None
    timeout = aiohttp.ClientTimeout(total=LONG_POLL_S + 30.0)
    options: dict[str, Any] = {
        "base_url": api_url,
        "headers": {"Authorization": f"Bearer {key}"},
        "timeout": timeout,
    }
    submitters = workload.jobs if prefer_wait else CONNECTIONS
    async with (
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=submitters), **options
        ) as submit,
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=workload.jobs), **options
        ) as poll,
    ):
        warmup = await _submit(submit, "Warm-up: say something.", workload, wait_s)
        await _wait_final(poll, warmup)

        t0 = time.perf_counter()
        prompts = workload.prompts(run)
        if batch_size is None:
            runs = await asyncio.gather(
                *(_submit_and_wait(submit, poll, p, workload, wait_s) for p in prompts)
            )
        else:
            chunks = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
            batches = await asyncio.gather(
                *(_submit_batch_and_wait(submit, poll, chunk, workload, wait_s) for chunk in chunks)
            )
            runs = [run for batch in batches for run in batch]
        submit_phase_s = max(posted for _, posted, _ in runs) - t0
        finals = [(job, done) for job, _, done in runs]

    ok = [job for job, _ in finals if job["status"] == "succeeded"]
    statuses = Counter(job["status"] for job, _ in finals)
    # The span the system itself recorded: first job created → last job finished.
    created = [datetime.fromisoformat(job["created_at"]) for job in ok]
    finished = [
        created_at.timestamp() + job["timings"]["total_s"]
        for job, created_at in zip(ok, created, strict=True)
    ]
    server_span_s = max(finished) - min(c.timestamp() for c in created) if ok else 0.0
    queue_s = [job["timings"]["queue_s"] for job in ok if job["timings"]["queue_s"] is not None]
    # First job created → last job started by the worker: how long the engine waited for the
    # whole workload to reach it (the engine alone has every request from its first submit).
    started = [
        created_at.timestamp() + job["timings"]["queue_s"]
        for job, created_at in zip(ok, created, strict=True)
        if job["timings"]["queue_s"] is not None
    ]
    start_span_s = max(started) - min(c.timestamp() for c in created) if started else 0.0
    return ModeResult(
        mode="inferq pipeline" if batch_size is None else f"inferq, batches of {batch_size}",
        jobs=len(finals),
        succeeded=len(ok),
        tokens=sum(job["usage"]["completion_tokens"] or 0 for job in ok),
        wall_s=max(done for _, done in finals) - t0,
        ttft_s=[job["timings"]["ttft_s"] for job in ok if job["timings"]["ttft_s"] is not None],
        latency_s=[done - t0 for _, done in finals],
        extra={
            "submit_phase_s": round(submit_phase_s, 4),
            "server_span_s": round(server_span_s, 4),
            "start_span_s": round(start_span_s, 4),
            "statuses": dict(statuses),
            "queue_p50_ms": round(percentile(queue_s, 50) * 1000, 2),
        },
    )


async def drive_vllm_server(url: str, model: str, workload: Workload, run: int = 0) -> ModeResult:
    """One warm-up request, then every job as its own `POST /v1/completions`, all at once.

    Each request waits for its whole answer (no streaming), over a connection of its own: what
    a user of inferq's one-POST mode gets from its long poll, without the queue in between.
    TTFT is not measured (a non-streamed answer has none to see).
    """
    timeout = aiohttp.ClientTimeout(total=JOB_DEADLINE_S)
    connector = aiohttp.TCPConnector(limit=workload.jobs)
    async with aiohttp.ClientSession(url, timeout=timeout, connector=connector) as session:
        await _complete(session, model, "Warm-up: say something.", workload)
        t0 = time.perf_counter()
        answers = await asyncio.gather(
            *(_complete(session, model, prompt, workload) for prompt in workload.prompts(run))
        )
    return ModeResult(
        mode="vLLM's own server",
        jobs=len(answers),
        succeeded=sum(tokens is not None for tokens, _ in answers),
        tokens=sum(tokens or 0 for tokens, _ in answers),
        wall_s=max(done for _, done in answers) - t0,
        ttft_s=[],
        latency_s=[done - t0 for _, done in answers],
    )


async def _complete(
    session: aiohttp.ClientSession, model: str, prompt: str, workload: Workload
) -> tuple[int | None, float]:
    """Completion tokens of one answer (None if it failed), and when it came."""
    body = {"model": model, "prompt": prompt, **workload.sampling()}
    async with session.post("/v1/completions", json=body) as response:
        answer = await response.json() if response.status == 200 else None
    tokens = answer["usage"]["completion_tokens"] if answer else None
    return tokens, time.perf_counter()


def _mark_done(done_at: list[float], index: int, _future: object) -> None:
    done_at[index] = time.perf_counter()


@contextmanager
def engine_alone(
    settings: Settings, workload: Workload, engine_metrics: bool = False
) -> Iterator[tuple[Callable[[int], ModeResult], float]]:
    """A VllmEngine in this process, warmed up; yields (run the workload once, start-up s).

    Each call of the runner submits every job at once. The engine is shut down on the way out.
    """
    from core.heap import freeze_heap
    from core.tiers import Tier, engine_priority
    from workers.engine import VllmEngine
    from workers.generation import GenerationRequest

    policy = settings.tier_policy(Tier.PREMIUM)

    def request(request_id: str, prompt: str) -> GenerationRequest:
        return GenerationRequest(
            request_id=request_id,
            prompt=prompt,
            sampling=workload.sampling(),
            priority=engine_priority(policy),
            timeout_s=policy.timeout_s,
        )

    # With engine metrics, the engine keeps the same per-step statistics a worker keeps.
    engine = VllmEngine(
        settings, device="cpu", num_gpus=0, stats_label="bench" if engine_metrics else None
    )
    try:
        started = time.perf_counter()
        engine.start()
        startup_s = time.perf_counter() - started
        engine.submit(request("bench-warmup", "Warm-up: say something.")).result()
        freeze_heap()  # as the worker does once it is up, and vLLM's own server after warm-up
        yield partial(_engine_run, engine, request, workload), startup_s
    finally:
        engine.shutdown()


def _engine_run(
    engine: Any, request: Callable[[str, str], Any], workload: Workload, run: int
) -> ModeResult:
    prompts = workload.prompts(run)
    submitted_at: list[datetime] = []
    done_at = [0.0] * len(prompts)
    futures = []
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        submitted_at.append(datetime.now(UTC))
        future = engine.submit(request(f"bench-{run}-{i}", prompt))
        future.add_done_callback(partial(_mark_done, done_at, i))
        futures.append(future)
    results = [future.result() for future in futures]
    wall_s = max(done_at) - t0

    ok = [r for r in results if r.status.value == "succeeded"]
    ttft = [
        (r.first_token_at - sent).total_seconds()
        for r, sent in zip(results, submitted_at, strict=True)
        if r.status.value == "succeeded" and r.first_token_at is not None
    ]
    return ModeResult(
        mode="engine alone",
        jobs=len(prompts),
        succeeded=len(ok),
        tokens=sum(r.completion_tokens for r in ok),
        wall_s=wall_s,
        ttft_s=ttft,
        latency_s=[t - t0 for t in done_at],
    )
