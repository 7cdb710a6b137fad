"""The same jobs through the vLLM engine alone and through the whole inferq pipeline, side by side.

Run: `.venv/bin/python bench/pipeline.py [--jobs 256 --max-tokens 64 --repeat 3 --batch-size 64
--stock --out DIR]`.

The engine alone (in this process), vLLM's own OpenAI server on the same engine arguments
(`vllm serve`, every job its own `/v1/completions` request) and a running inferq stack stay up
side by side, and the workload runs in `--repeat` rounds, each of them through all four modes
in turn. Each mode reports its median run; the throughput ratio is the median of the rounds'
ratios, each run over the engine-alone run of its own round. On a shared host one run of a
few seconds can be off by ±20%, and the machine's speed drifts over minutes: comparing modes
that ran minutes apart measured the host as much as inferq.

With `--stock`, a second inferq stack runs on stock Celery (`INFERQ_CELERY_MODE=stock`: kombu's
own Redis transport, Celery's task strategy, `send_task`) beside the first, and each round
drives it the same two ways: the cost of running without `core.celery_compat`'s adaptations.
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from drivers import (
    CONNECTIONS,
    JOB_DEADLINE_S,
    Workload,
    drive_pipeline,
    drive_vllm_server,
    engine_alone,
)
from report import (
    ModeResult,
    add_model_argument,
    bench_model,
    bench_settings,
    cpu_use,
    descendants,
    format_table,
    machine_info,
    model_facts,
    model_line,
    paused,
    percentile,
    running_stack,
    save_chart,
    write_report,
)
from vllm_server import vllm_server

from core.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[1]
THROUGHPUT_TARGET = 0.90
BATCH_SIZE = 64
"""Jobs per `POST /v1/jobs/batch` in the batched mode, unless `--batch-size` says otherwise."""


def median_run(runs: list[ModeResult]) -> ModeResult:
    """The run with the median throughput; every run's tokens/s goes in its `extra`."""
    ordered = sorted(runs, key=lambda run: run.tokens_per_s)
    median = ordered[(len(ordered) - 1) // 2]
    median.extra["runs_tokens_per_s"] = [round(run.tokens_per_s, 1) for run in runs]
    return median


@dataclass
class Rounds:
    """Every mode's run of each round: the engine alone, vLLM's server, then inferq's modes."""

    engine: list[ModeResult] = field(default_factory=list)
    server: list[ModeResult] = field(default_factory=list)
    single: list[ModeResult] = field(default_factory=list)
    batched: list[ModeResult] = field(default_factory=list)
    stock_single: list[ModeResult] = field(default_factory=list)
    stock_batched: list[ModeResult] = field(default_factory=list)

    def pipelines(self) -> list[list[ModeResult]]:
        """Each inferq mode's runs, those on stock Celery last (if run)."""
        modes = [self.single, self.batched, self.stock_single, self.stock_batched]
        return [runs for runs in modes if runs]

    def paired_ratios(self, mode: list[ModeResult]) -> list[float]:
        """Per round, that mode's throughput over the engine alone's in the same round."""
        return [
            run.tokens_per_s / engine.tokens_per_s
            for run, engine in zip(mode, self.engine, strict=True)
            if engine.tokens_per_s > 0
        ]


@dataclass(frozen=True)
class Startup:
    """Seconds each side took to start."""

    engine: float
    server: float
    stack: float
    stock_stack: float = 0.0


def run_rounds(
    settings: Settings,
    workload: Workload,
    args: argparse.Namespace,
) -> tuple[Rounds, Startup]:
    """Start the engine alone, vLLM's server and a stack side by side; run `repeat` rounds.

    All three stay up through every round, so each round compares the modes within the same
    minute: on a shared host, the speed of the machine drifts by a fifth over the minutes that
    running one mode after the other took. While one side runs, the others' processes are
    stopped (SIGSTOP), so no mode pays for another's idle timers and heartbeats. `args` give
    the rounds, engine metrics, inferq's client and its batch size. Each server's port is
    picked just before it starts: one picked earlier could be taken meanwhile by the engine's
    own sockets.
    """
    from inferq.local import free_port

    rounds = Rounds()
    server_log = settings.data_dir / "vllm-server.log"
    repeat, prefer_wait = args.repeat, not args.no_prefer_wait
    with engine_alone(settings, workload, args.engine_metrics) as (run_engine, startup_s):
        engine_processes = descendants()  # its engine core and forward pass
        started = time.perf_counter()
        with vllm_server(settings, free_port(), server_log) as (server_url, server_pid):
            server_startup_s = time.perf_counter() - started
            server_processes = {server_pid} | descendants(server_pid)
            with (
                running_stack(settings, free_port()) as (api_url, key, stack_startup_s),
                _stock_stack(settings, args.stock) as stock,
            ):
                stock_processes = stock.processes if stock else set()
                stack_processes = (
                    descendants() - engine_processes - server_processes - stock_processes
                )
                sides = engine_processes | server_processes | stack_processes | stock_processes
                everything = sides | {os.getpid()}
                for index in range(repeat):
                    # Fresh prompts for every run: no run reuses another's cached prefixes.
                    print(f"round {index + 1}/{repeat} …", flush=True)
                    run = 4 * index
                    with paused(sides - engine_processes):
                        rounds.engine.append(_measured(everything, partial(run_engine, run)))
                    with paused(sides - server_processes):
                        server = drive_vllm_server(
                            server_url, settings.model_name, workload, run + 1
                        )
                        rounds.server.append(_measured(everything, partial(asyncio.run, server)))
                    with paused(sides - stack_processes):
                        single = drive_pipeline(
                            api_url, key, workload, run=run + 2, prefer_wait=prefer_wait
                        )
                        rounds.single.append(_measured(everything, partial(asyncio.run, single)))
                        batched = drive_pipeline(
                            api_url, key, workload, args.batch_size, run + 3, prefer_wait
                        )
                        rounds.batched.append(_measured(everything, partial(asyncio.run, batched)))
                    if stock is not None:
                        with paused(sides - stock_processes):
                            for batch_size, runs in (
                                (None, rounds.stock_single),
                                (args.batch_size, rounds.stock_batched),
                            ):
                                drive = drive_pipeline(
                                    stock.api_url, stock.key, workload, batch_size, run, prefer_wait
                                )
                                result = _measured(everything, partial(asyncio.run, drive))
                                result.mode += " · stock Celery"
                                runs.append(result)
    stock_startup_s = stock.startup_s if stock is not None else 0.0
    return rounds, Startup(startup_s, server_startup_s, stack_startup_s, stock_startup_s)


@dataclass(frozen=True)
class StockStack:
    """The stack on stock Celery: where it answers, its key, processes and start-up time."""

    api_url: str
    key: str
    processes: set[int]
    startup_s: float


@contextmanager
def _stock_stack(settings: Settings, wanted: bool) -> Iterator[StockStack | None]:
    """A second stack, on stock Celery, in a directory (and database) of its own; or None."""
    from inferq.local import free_port

    if not wanted:
        yield None
        return
    before = descendants()
    own = bench_settings(settings.data_dir / "stock", Path(settings.model_path))
    env = {"INFERQ_CELERY_MODE": "stock"}
    with running_stack(own, free_port(), env=env) as (api_url, key, startup_s):
        yield StockStack(api_url, key, descendants() - before, startup_s)


def _measured(pids: set[int], run: Callable[[], ModeResult]) -> ModeResult:
    """Run one mode, noting each process role's CPU seconds in its `extra["cpu_s"]`."""
    with cpu_use(pids) as used:
        result = run()
    result.extra["cpu_s"] = dict(sorted(used.items(), key=lambda item: -item[1]))
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_argument(parser)
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
    parser.add_argument(
        "--batch-size",
        type=int,
        default=BATCH_SIZE,
        help="jobs per POST /v1/jobs/batch in the batched mode (at most the API's batch limit)",
    )
    parser.add_argument(
        "--no-prefer-wait",
        action="store_true",
        help="inferq's client submits, then long-polls each job, instead of asking the "
        "submission itself to wait for the end (Prefer: wait=30)",
    )
    parser.add_argument(
        "--stock",
        action="store_true",
        help="also run a stack on stock Celery (INFERQ_CELERY_MODE=stock) and drive it the "
        "same two ways in every round",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument(
        "--database-url", default=None, help="default: a fresh SQLite file in a temp dir"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.batch_size <= 1000:
        parser.error("--batch-size takes 1 to 1000 jobs (the API's limit for one batch)")
    return args


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

    workload = Workload(args.jobs, args.max_tokens)
    machine = machine_info()
    work_dir = Path(tempfile.mkdtemp(prefix="inferq-bench-"))
    # One Settings for every mode; the children read the same values from their environment.
    model_dir = bench_model(args.model)
    model = model_facts(model_dir)
    settings = bench_settings(work_dir, model_dir, args.database_url)
    print(
        f"machine : {machine['cpu_count']} CPUs, {machine['cpu_model']}; "
        f"Python {machine['python']}, {machine['vllm']}\n"
        f"{model_line(model)}\n"
        f"workload: {workload.jobs} jobs x {workload.max_tokens} tokens, ignore_eos, "
        f"temperature {workload.temperature:g}; max_num_seqs {settings.max_num_seqs}, "
        f"worker concurrency {settings.worker_concurrency}; inferq's client: "
        + (
            f"submit over {CONNECTIONS} connections, then a long poll per job"
            if args.no_prefer_wait
            else "submit with Prefer: wait=30 (a connection each), long-poll what is not final"
        )
        + "; engine metrics "
        f"{'on' if args.engine_metrics else 'off'} in both modes; {args.repeat} rounds of "
        "every mode, the median run reported, ratios paired within rounds\n"
        "\n",
        flush=True,
    )
    succeeded = False
    try:
        print("starting the engine alone here, vLLM's server, and redis, worker and API …")
        rounds, startup = run_rounds(settings, workload, args)
        succeeded = True
    finally:
        if succeeded:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            print(f"kept {work_dir} (logs under logs/, vLLM's server's in it)", file=sys.stderr)
    report = summarize(rounds, startup)
    run_settings = {
        "max_num_seqs": settings.max_num_seqs,
        "worker_concurrency": settings.worker_concurrency,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "engine_metrics": args.engine_metrics,
        "repeat": args.repeat,
        "prefer_wait": not args.no_prefer_wait,
        "batch_size": args.batch_size,
        "stock_celery_compared": args.stock,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = f"{workload.jobs}x{workload.max_tokens}"
    chart = args.out / f"pipeline-{stamp}.png"
    ratio = report["throughput_ratio"][rounds.single[0].mode]
    title = (
        f"{workload.jobs} jobs x {workload.max_tokens} tokens on {machine['cpu_count']} CPUs "
        f"— inferq/engine = {ratio:.2f}"
    )
    save_chart(report.pop("results"), title, chart)
    write_report(
        args.out / f"pipeline-{stamp}.json",
        chart,
        machine,
        model,
        {**workload.__dict__, "ignore_eos": True, "connections": CONNECTIONS},
        settings=run_settings,
        **report,
    )
    return 0


def summarize(rounds: Rounds, startup: Startup) -> dict[str, Any]:
    """Print the table, ratios and CPU use; return the figures (and, under `results`, the runs).

    Each mode's ratio pairs its run of every round with the engine-alone run of that round.
    """
    engine = median_run(rounds.engine)
    engine.extra["startup_s"] = round(startup.engine, 2)
    server = median_run(rounds.server)
    server.extra["startup_s"] = round(startup.server, 2)
    pipelines = [median_run(runs) for runs in rounds.pipelines()]
    for result in pipelines:
        stock = result.mode.endswith("stock Celery")
        result.extra["startup_s"] = round(startup.stock_stack if stock else startup.stack, 2)
    results = [engine, server, *pipelines]
    print()
    print(format_table(results))
    if not engine.succeeded:
        raise SystemExit("the engine alone finished no job; nothing to compare with")
    paired = {
        server.mode: rounds.paired_ratios(rounds.server),
        **{
            result.mode: rounds.paired_ratios(runs)
            for result, runs in zip(pipelines, rounds.pipelines(), strict=True)
        },
    }
    ratios = {mode: statistics.median(values) for mode, values in paired.items()}
    added_ttft_ms = {
        p.mode: (percentile(p.ttft_s, 50) - percentile(engine.ttft_s, 50)) * 1000 for p in pipelines
    }
    print()
    for mode, values in paired.items():
        each = ", ".join(f"{r:.2f}" for r in values)
        print(
            f"{mode}: throughput / engine alone = {ratios[mode]:.2f} (target for inferq ≥ "
            f"{THROUGHPUT_TARGET:.2f}; median of the rounds' {each})"
        )
    # inferq against vLLM's server, paired the same way.
    for pipeline, runs in zip(pipelines, rounds.pipelines(), strict=True):
        against = [
            mine.tokens_per_s / theirs.tokens_per_s
            for mine, theirs in zip(runs, rounds.server, strict=True)
            if theirs.tokens_per_s > 0
        ]
        if against:
            print(f"{pipeline.mode}: throughput / vLLM's server = {statistics.median(against):.2f}")
    for pipeline in pipelines:
        print(
            f"{pipeline.mode}: added TTFT p50 = {added_ttft_ms[pipeline.mode]:.0f} ms; last "
            f"submission answered {pipeline.extra['submit_phase_s']:.2f} s; first created → last "
            f"started {pipeline.extra['start_span_s']:.2f} s, → last finished "
            f"{pipeline.extra['server_span_s']:.2f} s"
        )
    for result in results:
        each_run = ", ".join(f"{value:,.0f}" for value in result.extra["runs_tokens_per_s"])
        print(f"{result.mode}: tokens/s of each run: {each_run}")
    print("(inferq's TTFT is the API's timings.ttft_s: job creation to first token; vLLM's")
    print("server answers whole completions, so its TTFT is not seen)")
    print("\nCPU seconds by process in each mode's median run (the benchmark process is the")
    print("engine's front end in the engine alone, the HTTP client in the other modes):")
    for result in results:
        used = result.extra["cpu_s"]
        parts = ", ".join(f"{role} {seconds:.2f}" for role, seconds in used.items() if seconds)
        print(f"{result.mode}: {sum(used.values()):.2f} s in {result.wall_s:.2f} s: {parts}")
    serving_ms = {result.mode: serving_ms_per_job(result) for result in results}
    print(
        "CPU ms per job besides the engine core (the serving side; on a CPU host it shares the "
        "vCPUs vLLM's forward pass leaves): "
        + ", ".join(f"{mode} {ms:.2f}" for mode, ms in serving_ms.items())
    )
    for result in results:
        if result.succeeded != result.jobs:
            print(f"WARNING: {result.mode}: only {result.succeeded}/{result.jobs} jobs succeeded")
    figures: dict[str, Any] = {
        "modes": [result.summary() for result in results],
        "throughput_ratio": {mode: round(r, 4) for mode, r in ratios.items()},
        "paired_ratios": {mode: [round(r, 4) for r in values] for mode, values in paired.items()},
        "throughput_target": THROUGHPUT_TARGET,
        "added_ttft_p50_ms": {mode: round(ms, 2) for mode, ms in added_ttft_ms.items()},
        "serving_cpu_ms_per_job": {mode: round(ms, 3) for mode, ms in serving_ms.items()},
        "results": results,
    }
    return figures


def serving_ms_per_job(result: ModeResult) -> float:
    """CPU milliseconds per job of every process but vLLM's engine core (and forward pass).

    In the engine alone that is its front end (this process); for vLLM's server, the server and
    the HTTP client; for inferq, the worker (the engine's front end included), API, Redis,
    scheduler and client. It is the cost per job a queue in front of the engine adds to it.
    """
    used = result.extra["cpu_s"]
    serving = sum(seconds for role, seconds in used.items() if role != "engine core")
    return 1000 * serving / result.jobs if result.jobs else 0.0


if __name__ == "__main__":
    sys.exit(main())
