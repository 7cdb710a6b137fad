"""SLA under load: one open-loop trace of mixed tiers, replayed on inferq and on vLLM's own server
(priority scheduling, then first come first served) at rising multiples of capacity.

The trace (see `sla_trace`): Poisson arrivals, 20% premium, 30% standard, 50% basic requests,
prompts of a few hundred to about 1,500 tokens and outputs up to each tier's token cap, both
times `--scale`; its seed is saved with the results, so a rerun replays the same requests.

Capacity, in the trace's jobs per second, comes first from a closed-loop calibration on inferq
(`--calibration-clients` jobs kept in flight for `--calibration-s` seconds: output tokens per
second while saturated, divided by the trace's mean output length), unless `--capacity` gives it.
Each level of `--levels` (multiples of capacity) then lasts `--duration` seconds of arrivals and
runs until its last request has ended; every system gets the same trace of each level:

- `inferq`: a local stack (own redis-server, SQLite, one CPU worker, the scheduler, the API)
  with its tier table's durations (timeout, queue limit, aging) times `--deadline-scale` through
  `INFERQ_TIERS`, so inferq itself ends a job at its tier's limit. One `POST /v1/jobs` per
  request with a key of the request's tier, then long polls; first token and end are read from
  the job's record, not from a live stream (see `sla_drivers` for why, and what it leaves out);
- `vllm-priority`: `python -m vllm.entrypoints.openai.api_server` on the worker's engine
  arguments (`--scheduling-policy priority`), each request a streamed `/v1/completions` with
  `priority` from its tier (as the worker maps it: premium first);
- `vllm-fcfs`: the same server with `--scheduling-policy fcfs` and no priorities.

Both vLLM servers stream in chunks of `INFERQ_STREAM_TOKENS` tokens (`--stream-interval`), as the
worker's engine does, and keep no per-step statistics (nor does the worker here:
`INFERQ_ENGINE_METRICS=false`), so the three engines do the same work per token. The systems run
one after another, each alone on the machine (inferq first, on the stack calibration ran on),
with their levels back to back.

One rule judges every request on every system (see `sla_drivers`): its tier's limit is the tier
policy's timeout times `--deadline-scale`; finished by `sent + limit`: completed; not: timed out
(a vLLM stream is closed at the deadline, which aborts the request); 429: refused. For each
system, level and tier: TTFT p50/p95 (of requests not refused; one with no first token within
its limit counts as the limit, and a percentile that lands on such a request is shown as
`>=limit`), time per output token (p50, completed requests), completed/timed out/refused/failed
%, and output tokens per second over the level's arrival window (each request's tokens taken as
made evenly from its first token to its end). "Served within SLA" is completed requests per
second of arrivals. A summary at 2x (or the level nearest it) has one column per system.

Writes `bench/results/sla-<model kind>.png` (premium TTFT p95 and completion % per level, a line
per system), `.json` (seed, capacity, levels, model, machine, every figure) and
`-requests.json` (every request's outcome).

Run: `.venv/bin/python bench/sla.py [--model real|tiny|DIR --scale 0.25 --deadline-scale 1
--levels 0.5,1,2,3 --duration 60 --calibration-s 30 --capacity JOBS_PER_S --seed 1
--systems inferq,vllm-priority,vllm-fcfs]`. The demo model's engine takes minutes to start
on a small CPU host, once per system.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
from report import (
    add_model_argument,
    bench_model,
    bench_settings,
    cpu_use,
    descendants,
    machine_info,
    model_facts,
    model_line,
    running_stack,
    write_report,
)
from sla_drivers import (
    Calibration,
    InferqSender,
    Outcome,
    Sender,
    VllmSender,
    calibrate,
    client_session,
    replay,
)
from sla_figures import LevelRun, format_results, format_summary, level_figures, save_chart
from sla_trace import (
    TIER_SHARES,
    TIERS,
    Trace,
    TraceMaker,
    scaled_tier_table,
    tier_limits,
    token_caps,
)
from vllm_server import vllm_server

from core.heap import freeze_heap
from core.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("inferq", "vllm-priority", "vllm-fcfs")
LEVEL_GAP_S = 5.0
"""Quiet time between two levels, so the next starts on an idle system."""
WORKER_START_S = 900.0


@dataclass(frozen=True)
class Context:
    """What every system's run shares: settings, tier limits, the traces and where logs go."""

    settings: Settings
    limits: dict[str, float]
    traces: list[Trace]
    warm_up: Trace
    log_dir: Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's options."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_argument(parser, default="real")
    parser.add_argument("--levels", default="0.5,1,2,3", help="multiples of capacity")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals a level")
    parser.add_argument("--scale", type=float, default=1.0, help="times prompt and output lengths")
    parser.add_argument(
        "--deadline-scale", type=float, default=1.0, help="times every tier's durations"
    )
    parser.add_argument("--capacity", type=float, help="jobs/s; default: measured on inferq")
    parser.add_argument("--calibration-s", type=float, default=30.0)
    parser.add_argument("--calibration-clients", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    args.level_list = [float(level) for level in args.levels.split(",")]
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.system_list) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown system(s) {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    # inferq first: it runs on the stack the calibration measured.
    args.system_list = [s for s in SYSTEMS if s in args.system_list]
    return args


SenderFactory = Callable[[aiohttp.ClientSession], Sender]
"""Makes a system's sender on a level's client session."""


def run_levels(system: str, sender: SenderFactory, base_url: str, ctx: Context) -> list[LevelRun]:
    """A warm-up, then every level's trace on one system, back to back; prints a line a level."""

    async def one(trace: Trace) -> tuple[float, list[Outcome]]:
        async with client_session(base_url) as session:
            return await replay(trace, sender(session))

    asyncio.run(one(ctx.warm_up))
    runs = []
    for trace in ctx.traces:
        time.sleep(LEVEL_GAP_S)
        # The traces and earlier levels' outcomes out of the collector's reach, so its full
        # collections do not stall the client mid-level (as `core.heap` explains for servers).
        freeze_heap()
        # This process (the client) and everything it started: the system under test.
        ours = descendants() | {os.getpid()}
        busy_before = machine_busy_s()
        with cpu_use(ours) as cpu:
            start, outcomes = asyncio.run(one(trace))
        busy = machine_busy_s() - busy_before
        others = round(max(0.0, busy - sum(cpu.values())), 2)
        run = LevelRun(system, trace, start, outcomes, cpu, others)
        runs.append(run)
        print(run.progress_line(), flush=True)
    return runs


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (every core, every process), from /proc/stat:
    less what this run's processes used, it is what others took from the run."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    # guest time is already counted in user time.
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_inferq(
    args: argparse.Namespace, settings: Settings, maker: TraceMaker, mean_output: float
) -> tuple[Calibration | None, float, Context, float, list[LevelRun] | None]:
    """Start the stack; calibrate unless `--capacity`; run the levels if inferq is a system.

    Returns the calibration (None with `--capacity`), the capacity, the context made with it,
    the stack's start-up seconds and inferq's runs (None if it is not a system).
    """
    from core.apikeys import KeyStore
    from core.db import Database
    from core.tiers import Tier
    from inferq.local import free_port

    tiers = json.dumps(scaled_tier_table(settings, args.deadline_scale))
    env = {"INFERQ_TIERS": tiers}
    with running_stack(settings, free_port(), env, worker_timeout_s=WORKER_START_S) as (
        api_url,
        key,
        startup_s,
    ):
        print(f"inferq stack up in {startup_s:.0f} s", flush=True)
        calibration = None
        capacity = args.capacity
        if capacity is None:
            print(
                f"calibrating: {args.calibration_clients} jobs in flight for "
                f"{args.calibration_s:g} s …",
                flush=True,
            )
            ours = descendants() | {os.getpid()}
            busy_before = machine_busy_s()
            with cpu_use(ours) as cpu:
                calibration = asyncio.run(
                    calibrate(
                        api_url,
                        key,
                        maker.calibration(),
                        args.calibration_clients,
                        args.calibration_s,
                        mean_output,
                    )
                )
            calibration.others_cpu_s = round(
                max(0.0, machine_busy_s() - busy_before - sum(cpu.values())), 2
            )
            capacity = calibration.jobs_per_s
            print(
                f"capacity: {calibration.tokens_per_s:.0f} output tokens/s = "
                f"{capacity:.2f} jobs/s of the trace (mean {mean_output:.0f} output tokens); "
                f"{calibration.jobs} jobs, statuses {calibration.statuses}, median job "
                f"{calibration.job_p50_s:.1f} s; CPU s other processes took meanwhile: "
                f"{calibration.others_cpu_s:.0f}",
                flush=True,
            )
            if calibration.too_short:
                print(
                    "warning: the median calibration job took over half the measured window; "
                    "raise --calibration-s (or lower --calibration-clients) for a steadier "
                    "figure",
                    flush=True,
                )
        ctx = make_context(args, settings, maker, capacity)
        if "inferq" not in args.system_list:
            return calibration, capacity, ctx, round(startup_s, 1), None
        store = KeyStore(Database(settings.sqlalchemy_url))
        keys = {tier: store.create(f"sla-{tier}", Tier(tier))[0] for tier in TIERS}

        runs = run_levels(
            "inferq", lambda session: InferqSender(session, keys, ctx.limits), api_url, ctx
        )
    return calibration, capacity, ctx, round(startup_s, 1), runs


def run_vllm(system: str, ctx: Context) -> tuple[float, list[LevelRun]]:
    """Start vLLM's server with the system's scheduling policy and run the levels on it."""
    from core.tiers import Tier, engine_priority
    from inferq.local import free_port

    settings = ctx.settings
    policy = "priority" if system == "vllm-priority" else "fcfs"
    overrides = {"scheduling_policy": policy, "stream_interval": settings.stream_tokens}
    priorities = None
    if policy == "priority":
        priorities = {t: engine_priority(settings.tier_policy(Tier(t))) for t in TIERS}
    started = time.perf_counter()
    log = ctx.log_dir / f"{system}.log"
    with vllm_server(settings, free_port(), log, overrides) as (url, _pid):
        startup_s = time.perf_counter() - started
        print(f"{system}: vLLM's server up in {startup_s:.0f} s", flush=True)

        runs = run_levels(
            system,
            lambda session: VllmSender(session, settings.model_name, ctx.limits, priorities),
            url,
            ctx,
        )
    return startup_s, runs


def make_context(
    args: argparse.Namespace, settings: Settings, maker: TraceMaker, capacity: float
) -> Context:
    """Every level's trace at `capacity`, and a short warm-up trace."""
    traces = [maker.level(level, level * capacity, args.duration) for level in args.level_list]
    # A handful of short requests over two seconds.
    warm = maker.level(0.0, 2.0, 2.0)
    short = [replace(r, max_tokens=min(r.max_tokens, 16)) for r in warm.requests]
    warm_up = replace(warm, requests=short)
    return Context(
        settings=settings,
        limits=tier_limits(settings, args.deadline_scale),
        traces=traces,
        warm_up=warm_up,
        log_dir=settings.data_dir,
    )


def main(argv: list[str] | None = None) -> int:
    """Calibrate, replay every level on every system; print the tables, save chart and JSON."""
    args = parse_args(argv)
    from workers.devices import DeviceSpec, pin_devices

    pin_devices(DeviceSpec("cpu"))  # before torch or vllm is imported, as the worker does
    # Like for like: vLLM's server keeps no per-step statistics, so neither does the worker.
    os.environ["INFERQ_ENGINE_METRICS"] = "false"

    machine = machine_info()
    work_dir = Path(tempfile.mkdtemp(prefix="inferq-bench-"))
    model_dir = bench_model(args.model)
    model = model_facts(model_dir)
    settings = bench_settings(work_dir, model_dir)
    limits = tier_limits(settings, args.deadline_scale)
    caps = token_caps(settings)
    maker = TraceMaker(model_dir, caps, args.scale, args.seed)
    mean_output = maker.mean_output_tokens()
    print(
        f"machine : {machine['cpu_count']} CPUs, {machine['cpu_model']}; {machine['vllm']}\n"
        f"{model_line(model)}\n"
        f"workload: seed {args.seed}; tiers {TIER_SHARES}; limits "
        f"{ {t: round(v, 2) for t, v in limits.items()} } s; token caps {caps} x scale "
        f"{args.scale:g}; levels {args.level_list} x capacity, {args.duration:g} s each; "
        f"systems {args.system_list}; logs in {work_dir}\n",
        flush=True,
    )

    runs: dict[str, list[LevelRun]] = {}
    startup: dict[str, float] = {}
    calibration = None
    if "inferq" in args.system_list or args.capacity is None:
        calibration, capacity, ctx, startup["inferq"], inferq_runs = run_inferq(
            args, settings, maker, mean_output
        )
        if inferq_runs is not None:
            runs["inferq"] = inferq_runs
    else:
        capacity = args.capacity
        ctx = make_context(args, settings, maker, capacity)
    failed: dict[str, str] = {}
    for system in args.system_list:
        if system == "inferq":
            continue
        try:
            startup_s, runs[system] = run_vllm(system, ctx)
        except SystemExit as exc:  # its server did not start: keep what the others measured
            failed[system] = str(exc)
            print(f"{system}: left out, {exc}", flush=True)
            continue
        startup[system] = round(startup_s, 1)
    if not runs:
        raise SystemExit("no system ran")

    figures = {
        system: {f"{run.trace.level:g}": level_figures(run) for run in system_runs}
        for system, system_runs in runs.items()
    }
    print("\n" + format_results(figures))
    summary_level, summary_table, summary = format_summary(figures, limits)
    print(f"\nAt {summary_level}x capacity ({capacity:.2f} jobs/s at 1x):\n{summary_table}")

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"sla-{model['kind']}"
    chart = args.out / f"{stem}.png"
    save_chart(figures, limits["premium"], capacity, model["name"], chart)
    requests_file = args.out / f"{stem}-requests.json"
    requests_file.write_text(
        json.dumps(
            {
                system: {f"{r.trace.level:g}": [o.summary() for o in r.outcomes] for r in rs}
                for system, rs in runs.items()
            }
        )
        + "\n"
    )
    workload = {
        "seed": args.seed,
        "scale": args.scale,
        "deadline_scale": args.deadline_scale,
        "tier_shares": TIER_SHARES,
        "tier_limits_s": limits,
        "tier_token_caps": caps,
        "output_caps_after_scale": {t: max(1, round(c * args.scale)) for t, c in caps.items()},
        "mean_output_tokens": round(mean_output, 2),
        "levels": args.level_list,
        "duration_s": args.duration,
        "systems": args.system_list,
        "traces": [trace.summary() for trace in ctx.traces],
        "inferq_tiers": scaled_tier_table(settings, args.deadline_scale),
        "stream_tokens": settings.stream_tokens,
        "max_num_seqs": settings.max_num_seqs,
    }
    write_report(
        args.out / f"{stem}.json",
        chart,
        machine,
        model,
        workload,
        capacity={
            "jobs_per_s": round(capacity, 4),
            "source": "--capacity" if calibration is None else "calibration on inferq",
            **({"calibration": calibration.summary()} if calibration else {}),
        },
        startup_s=startup,
        **({"failed_systems": failed} if failed else {}),
        results=figures,
        summary={"level": summary_level, **summary},
        requests_file=str(requests_file),
    )
    shutil.rmtree(work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
