"""The same jobs through the vLLM engine alone and through the whole inferq pipeline, side by side.

Run: `.venv/bin/python bench/pipeline.py [--jobs 256 --max-tokens 64 --repeat 3 --out DIR]`.

The engine alone (in this process) and a running stack stay up side by side, and the workload
runs in `--repeat` rounds, each of them through all three modes in turn. Each mode reports its
median run; the throughput ratio is the median of the rounds' ratios, each pipeline run over
the engine-alone run of its own round. On a shared host one run of a few seconds can be off by
±20%, and the machine's speed drifts over minutes: comparing modes that ran minutes apart
measured the host as much as inferq.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
from report import (
    ModeResult,
    cpu_use,
    descendants,
    format_table,
    machine_info,
    paused,
    percentile,
    running_stack,
    save_chart,
)

from core.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[1]
FINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled", "timed_out"})
CONNECTIONS = 64
LONG_POLL_S = 30
JOB_DEADLINE_S = 600.0
THROUGHPUT_TARGET = 0.90
BATCH_SIZE = 64


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


def _mark_done(done_at: list[float], index: int, _future: object) -> None:
    done_at[index] = time.perf_counter()


def median_run(runs: list[ModeResult]) -> ModeResult:
    """The run with the median throughput; every run's tokens/s goes in its `extra`."""
    ordered = sorted(runs, key=lambda run: run.tokens_per_s)
    median = ordered[(len(ordered) - 1) // 2]
    median.extra["runs_tokens_per_s"] = [round(run.tokens_per_s, 1) for run in runs]
    return median


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


async def _submit(
    session: aiohttp.ClientSession, prompt: str, workload: Workload
) -> dict[str, Any]:
    body = {"prompt": prompt, **workload.sampling()}
    async with session.post("/v1/jobs", json=body) as response:
        if response.status not in (200, 202):
            raise RuntimeError(f"POST /v1/jobs answered {response.status}: {await response.text()}")
        job: dict[str, Any] = await response.json()
    return job


async def _wait_final(session: aiohttp.ClientSession, job_id: str) -> tuple[dict[str, Any], float]:
    deadline = time.perf_counter() + JOB_DEADLINE_S
    while time.perf_counter() < deadline:
        async with session.get(f"/v1/jobs/{job_id}", params={"wait": LONG_POLL_S}) as response:
            response.raise_for_status()
            job: dict[str, Any] = await response.json()
        if job["status"] in FINAL_STATUSES:
            return job, time.perf_counter()
    raise TimeoutError(f"job {job_id} was not final after {JOB_DEADLINE_S:g} s")


async def _submit_and_wait(
    submit: aiohttp.ClientSession, poll: aiohttp.ClientSession, prompt: str, workload: Workload
) -> tuple[dict[str, Any], float, float]:
    """What one user does: submit, then long-poll until final; returns (job, posted, final)."""
    job = await _submit(submit, prompt, workload)
    posted = time.perf_counter()
    final, done = await _wait_final(poll, job["id"])
    return final, posted, done


async def _submit_batch_and_wait(
    submit: aiohttp.ClientSession,
    poll: aiohttp.ClientSession,
    prompts: list[str],
    workload: Workload,
) -> list[tuple[dict[str, Any], float, float]]:
    """Submit several jobs in one `POST /v1/jobs/batch`, then long-poll each until final."""
    body = {"jobs": [{"prompt": p, **workload.sampling()} for p in prompts]}
    async with submit.post("/v1/jobs/batch", json=body) as response:
        if response.status != 202:
            detail = await response.text()
            raise RuntimeError(f"POST /v1/jobs/batch answered {response.status}: {detail}")
        jobs = (await response.json())["data"]
    posted = time.perf_counter()
    finals = await asyncio.gather(*(_wait_final(poll, job["id"]) for job in jobs))
    return [(job, posted, done) for job, done in finals]


async def drive_pipeline(
    api_url: str, key: str, workload: Workload, batch_size: int | None = None, run: int = 0
) -> ModeResult:
    """One warm-up job, then every job submitted concurrently, each long-polled until final.

    Submissions share `CONNECTIONS` connections; each waiting job's long poll has a connection
    of its own, as each user would (polls that queued for a shared connection would hold back
    submissions, and see jobs end late). With `batch_size`, jobs go in `POST /v1/jobs/batch`
    requests of that many, sent concurrently.
    """
    # aiohttp rather than httpx: on a 2-core host httpx's per-request CPU cost took more of the
    # machine than the API itself, and the client is not what is being measured.
    timeout = aiohttp.ClientTimeout(total=LONG_POLL_S + 30.0)
    options: dict[str, Any] = {
        "base_url": api_url,
        "headers": {"Authorization": f"Bearer {key}"},
        "timeout": timeout,
    }
    async with (
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=CONNECTIONS), **options
        ) as submit,
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=workload.jobs), **options
        ) as poll,
    ):
        warmup = await _submit(submit, "Warm-up: say something.", workload)
        await _wait_final(poll, warmup["id"])

        t0 = time.perf_counter()
        prompts = workload.prompts(run)
        if batch_size is None:
            runs = await asyncio.gather(
                *(_submit_and_wait(submit, poll, p, workload) for p in prompts)
            )
        else:
            chunks = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
            batches = await asyncio.gather(
                *(_submit_batch_and_wait(submit, poll, chunk, workload) for chunk in chunks)
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
            "statuses": dict(statuses),
            "queue_p50_ms": round(percentile(queue_s, 50) * 1000, 2),
        },
    )


@dataclass
class Rounds:
    """Every mode's run of each round; a round runs the engine alone, then the pipeline's modes."""

    engine: list[ModeResult] = field(default_factory=list)
    single: list[ModeResult] = field(default_factory=list)
    batched: list[ModeResult] = field(default_factory=list)

    def paired_ratios(self, mode: list[ModeResult]) -> list[float]:
        """Per round, that mode's throughput over the engine alone's in the same round."""
        return [
            pipeline.tokens_per_s / engine.tokens_per_s
            for pipeline, engine in zip(mode, self.engine, strict=True)
            if engine.tokens_per_s > 0
        ]


def run_rounds(
    settings: Settings, workload: Workload, api_port: int, repeat: int, engine_metrics: bool
) -> tuple[Rounds, float, float]:
    """Start the engine alone and a stack side by side; run `repeat` rounds of all three modes.

    Both stay up through every round, so each round compares the modes within the same minute:
    on a shared host, the speed of the machine drifts by a fifth over the minutes that running
    one mode after the other took. While one side runs, the other's processes are stopped
    (SIGSTOP), so neither mode pays for the other's idle timers and heartbeats. Returns the
    rounds and both start-up times (engine, stack).
    """
    rounds = Rounds()
    with engine_alone(settings, workload, engine_metrics) as (run_engine, engine_startup_s):
        engine_processes = descendants()  # its engine core and forward pass
        with running_stack(settings, api_port) as (api_url, key, stack_startup_s):
            stack_processes = descendants() - engine_processes
            everything = engine_processes | stack_processes | {os.getpid()}
            for index in range(repeat):
                # Fresh prompts for every run: no run reuses another's cached prefixes.
                print(f"round {index + 1}/{repeat} …", flush=True)
                with paused(stack_processes):
                    rounds.engine.append(_measured(everything, partial(run_engine, 3 * index)))
                with paused(engine_processes):
                    single = drive_pipeline(api_url, key, workload, run=3 * index + 1)
                    rounds.single.append(_measured(everything, partial(asyncio.run, single)))
                    batched = drive_pipeline(
                        api_url, key, workload, batch_size=BATCH_SIZE, run=3 * index + 2
                    )
                    rounds.batched.append(_measured(everything, partial(asyncio.run, batched)))
    return rounds, engine_startup_s, stack_startup_s


def _measured(pids: set[int], run: Callable[[], ModeResult]) -> ModeResult:
    """Run one mode, noting each process role's CPU seconds in its `extra["cpu_s"]`."""
    with cpu_use(pids) as used:
        result = run()
    result.extra["cpu_s"] = dict(sorted(used.items(), key=lambda item: -item[1]))
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--engine-metrics",
        action="store_true",
        help="keep vLLM's per-step statistics in both modes (INFERQ_ENGINE_METRICS, on in "
        "production by default); without it, neither mode keeps them",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="rounds; each runs every mode once, and the median is reported",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument(
        "--model", type=Path, default=None, help="default: .inferq/model, else a fresh local model"
    )
    parser.add_argument(
        "--database-url", default=None, help="default: a fresh SQLite file in a temp dir"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run both modes, print the table, save the chart and the JSON."""
    args = parse_args(argv)
    from workers.devices import DeviceSpec, pin_devices

    pin_devices(DeviceSpec("cpu"))  # before torch or vllm is imported, as the worker does
    # Throughput is measured, not deadlines: a slow host must not time the jobs out (premium's
    # 30 s would end 256 x 512 tokens on a 2-core machine). The children inherit this too.
    os.environ["INFERQ_TIERS"] = json.dumps({"premium": {"timeout_s": JOB_DEADLINE_S}})
    # Like for like: the worker's engine keeps per-step statistics only if the engine alone does.
    os.environ["INFERQ_ENGINE_METRICS"] = "true" if args.engine_metrics else "false"

    from inferq.local import free_port
    from workers.localmodel import init_local_model, is_model_dir

    workload = Workload(args.jobs, args.max_tokens)
    machine = machine_info()
    work_dir = Path(tempfile.mkdtemp(prefix="inferq-bench-"))
    model_dir = args.model or REPO_ROOT / ".inferq" / "model"
    if not is_model_dir(model_dir):
        model_dir = init_local_model(work_dir / "model")
    # One Settings for both modes; the children read the same values from their environment.
    # The Redis URL points at a port nobody serves, so LocalStack starts its own redis-server.
    settings = Settings(
        data_dir=work_dir,
        database_url=args.database_url or f"sqlite:///{work_dir / 'inferq.db'}",
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        model=str(model_dir.resolve()),
    )
    print(
        f"machine : {machine['cpu_count']} CPUs, {machine['cpu_model']}; "
        f"Python {machine['python']}, {machine['vllm']}\n"
        f"workload: {workload.jobs} jobs x {workload.max_tokens} tokens, ignore_eos, "
        f"temperature {workload.temperature:g}; max_num_seqs {settings.max_num_seqs}, "
        f"worker concurrency {settings.worker_concurrency}; {CONNECTIONS} HTTP connections "
        "for submissions, one per long poll; engine metrics "
        f"{'on' if args.engine_metrics else 'off'} in both modes; {args.repeat} rounds of "
        "every mode, the median run reported, ratios paired within rounds\n"
        f"model   : {settings.model_path}\n",
        flush=True,
    )
    succeeded = False
    try:
        print("starting the engine alone in this process, and redis, worker and API …", flush=True)
        rounds, engine_startup_s, stack_startup_s = run_rounds(
            settings, workload, free_port(), args.repeat, args.engine_metrics
        )
        succeeded = True
    finally:
        if succeeded:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            print(f"kept {work_dir} (logs under logs/)", file=sys.stderr)

    engine = median_run(rounds.engine)
    engine.extra["startup_s"] = round(engine_startup_s, 2)
    pipelines = [median_run(rounds.single), median_run(rounds.batched)]
    for result in pipelines:
        result.extra["startup_s"] = round(stack_startup_s, 2)
    results = [engine, *pipelines]
    if not engine.succeeded:
        print(format_table(results))
        raise SystemExit("the engine alone finished no job; nothing to compare with")
    # The headline ratio pairs each pipeline run with the engine-alone run of its own round.
    paired = {
        pipelines[0].mode: rounds.paired_ratios(rounds.single),
        pipelines[1].mode: rounds.paired_ratios(rounds.batched),
    }
    ratios = {mode: statistics.median(values) for mode, values in paired.items()}
    ratios_of_medians = {p.mode: p.tokens_per_s / engine.tokens_per_s for p in pipelines}
    added_ttft_ms = {
        p.mode: (percentile(p.ttft_s, 50) - percentile(engine.ttft_s, 50)) * 1000 for p in pipelines
    }
    print()
    print(format_table(results))
    print()
    for pipeline in pipelines:
        span = pipeline.extra["server_span_s"]
        print(
            f"{pipeline.mode}: throughput / engine = {ratios[pipeline.mode]:.2f}"
            f" (target ≥ {THROUGHPUT_TARGET:.2f}; median of the rounds' "
            f"{', '.join(f'{r:.2f}' for r in paired[pipeline.mode])}); added TTFT p50 ="
            f" {added_ttft_ms[pipeline.mode]:.0f} ms; submit phase"
            f" {pipeline.extra['submit_phase_s']:.2f} s; first created → last finished {span:.2f} s"
        )
    for result in results:
        runs = ", ".join(f"{value:,.0f}" for value in result.extra["runs_tokens_per_s"])
        print(f"{result.mode}: tokens/s of each run: {runs}")
    print("(pipeline TTFT is the API's timings.ttft_s: job creation to first token)")
    print("\nCPU seconds by process in each mode's median run (the benchmark process is the")
    print("engine's front end in the engine alone, the HTTP client in the pipeline's modes):")
    for result in results:
        used = result.extra["cpu_s"]
        total = sum(used.values())
        parts = ", ".join(f"{role} {seconds:.2f}" for role, seconds in used.items() if seconds)
        print(f"{result.mode}: {total:.2f} s in {result.wall_s:.2f} s of wall time: {parts}")
    for result in results:
        if result.succeeded != result.jobs:
            print(f"WARNING: {result.mode}: only {result.succeeded}/{result.jobs} jobs succeeded")

    args.out.mkdir(parents=True, exist_ok=True)
    stamp = f"{workload.jobs}x{workload.max_tokens}"
    chart = args.out / f"pipeline-{stamp}.png"
    title = (
        f"{workload.jobs} jobs x {workload.max_tokens} tokens on {machine['cpu_count']} CPUs "
        f"— pipeline/engine = {ratios[pipelines[0].mode]:.2f}"
    )
    save_chart(results, title, chart)
    report = {
        "created_at": datetime.now(UTC).isoformat(),
        "machine": machine,
        "workload": {
            **workload.__dict__,
            "ignore_eos": True,
            "connections": CONNECTIONS,
            "repeat": args.repeat,
        },
        "settings": {
            "max_num_seqs": settings.max_num_seqs,
            "worker_concurrency": settings.worker_concurrency,
            "enable_prefix_caching": settings.enable_prefix_caching,
            "engine_metrics": args.engine_metrics,
        },
        "modes": [result.summary() for result in results],
        "throughput_ratio": {mode: round(r, 4) for mode, r in ratios.items()},
        "paired_ratios": {mode: [round(r, 4) for r in values] for mode, values in paired.items()},
        "throughput_ratio_of_medians": {mode: round(r, 4) for mode, r in ratios_of_medians.items()},
        "throughput_target": THROUGHPUT_TARGET,
        "added_ttft_p50_ms": {mode: round(ms, 2) for mode, ms in added_ttft_ms.items()},
    }
    figures = args.out / f"pipeline-{stamp}.json"
    figures.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {chart} and {figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
