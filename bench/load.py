"""Load: how fast can jobs be submitted, and does the API stay responsive when it can't keep up?

An open-loop load generator (aiohttp) sends `POST /v1/jobs` at rising rates (`--rates`, jobs
per second, `--step-s` seconds each): requests are sent on a fixed schedule, whether or not
earlier ones have been answered, as independent clients would. Per step it measures the
enqueue latency (request sent → 202), errors, the rate actually achieved, and, from a
separate connection, `/healthz` every 100 ms. It reports the highest rate sustained (at least
95% of the target achieved, no errors) with p95 enqueue latency under 50 ms.

The stack is a fresh local one (own redis-server, SQLite, the scheduler, the API). By default
it runs **no worker**: the jobs only pile up in Redis and the database, so the figures are the
API's submission path alone, and a worker does not take CPU from the API on the same small
machine (on a real deployment workers sit on GPU hosts). `--worker` adds one CPU worker. Either
way the premium tier's deadline is raised to an hour (`INFERQ_TIERS`), so the growing backlog
neither times out in the queue nor makes admission control answer 429 `queue_full` during
the run (with a worker, its measured throughput against a one-hour queue limit admits far
more than a run submits). The key has no quotas.

Run: `.venv/bin/python bench/load.py [--rates 25,50,100,200,400,800 --step-s 12 --worker]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
from report import (
    add_model_argument,
    bench_model,
    bench_settings,
    machine_info,
    model_facts,
    model_line,
    own_redis,
    percentile,
    running_stack,
    write_report,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
P95_TARGET_MS = 50.0
SUSTAINED_SHARE = 0.95
HEALTH_PROBE_S = 0.1
CONNECTIONS = 512
HOUR_TIERS = {"premium": {"timeout_s": 3600}}


@dataclass
class Step:
    """What one rate step measured."""

    target_rate: float
    duration_s: float
    sent: int = 0
    accepted: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latency_ms: list[float] = field(default_factory=list)
    health_ms: list[float] = field(default_factory=list)
    health_errors: int = 0
    send_lag_ms: list[float] = field(default_factory=list)
    waiting_after: int = 0
    answered_s: float = 0.0

    @property
    def achieved_rate(self) -> float:
        """Jobs accepted per second, over the time from the first send to the last answer."""
        return self.accepted / self.answered_s if self.answered_s > 0 else 0.0

    @property
    def sustained(self) -> bool:
        """Whether the step kept up: no errors and at least 95% of the target rate."""
        return not self.errors and self.achieved_rate >= SUSTAINED_SHARE * self.target_rate

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures."""
        return {
            "target_rate": self.target_rate,
            "duration_s": self.duration_s,
            "sent": self.sent,
            "accepted": self.accepted,
            "achieved_rate": round(self.achieved_rate, 1),
            "sustained": self.sustained,
            "errors": self.errors,
            "enqueue_p50_ms": round(percentile(self.latency_ms, 50), 2),
            "enqueue_p95_ms": round(percentile(self.latency_ms, 95), 2),
            "enqueue_p99_ms": round(percentile(self.latency_ms, 99), 2),
            "enqueue_max_ms": round(max(self.latency_ms, default=float("nan")), 2),
            "send_lag_p95_ms": round(percentile(self.send_lag_ms, 95), 2),
            "healthz_probes": len(self.health_ms),
            "healthz_errors": self.health_errors,
            "healthz_p50_ms": round(percentile(self.health_ms, 50), 2),
            "healthz_p95_ms": round(percentile(self.health_ms, 95), 2),
            "healthz_max_ms": round(max(self.health_ms, default=float("nan")), 2),
            "jobs_waiting_after": self.waiting_after,
        }


async def _post_job(session: aiohttp.ClientSession, body: dict[str, Any], step: Step) -> float:
    """One submission; records its latency or error; returns when it was answered."""
    started = time.perf_counter()
    try:
        async with session.post("/v1/jobs", json=body) as response:
            await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        key = type(exc).__name__
        step.errors[key] = step.errors.get(key, 0) + 1
        return time.perf_counter()
    answered = time.perf_counter()
    if status == 202:
        step.accepted += 1
        step.latency_ms.append((answered - started) * 1000)
    else:
        step.errors[str(status)] = step.errors.get(str(status), 0) + 1
    return answered


async def _probe_health(api_url: str, step: Step, stopped: asyncio.Event) -> None:
    """GET /healthz every 100 ms on a connection of its own until `stopped`."""
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(base_url=api_url, timeout=timeout) as session:
        while not stopped.is_set():
            started = time.perf_counter()
            try:
                async with session.get("/healthz") as response:
                    await response.read()
                    ok = response.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if ok:
                step.health_ms.append((time.perf_counter() - started) * 1000)
            else:
                step.health_errors += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), HEALTH_PROBE_S)


async def run_step(
    session: aiohttp.ClientSession, api_url: str, rate: float, duration_s: float, max_tokens: int
) -> Step:
    """Send `rate` jobs a second for `duration_s` on a fixed schedule; wait for every answer."""
    step = Step(target_rate=rate, duration_s=duration_s)
    stopped = asyncio.Event()
    prober = asyncio.create_task(_probe_health(api_url, step, stopped))
    total = int(rate * duration_s)
    tasks = []
    t0 = time.perf_counter()
    for i in range(total):
        due = t0 + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        step.send_lag_ms.append(max(0.0, time.perf_counter() - due) * 1000)
        body = {"prompt": f"Load {rate:g}/s, job {i}: hello.", "max_tokens": max_tokens}
        tasks.append(asyncio.create_task(_post_job(session, body, step)))
        step.sent += 1
    answered = await asyncio.gather(*tasks)
    step.answered_s = max(answered, default=t0) - t0
    stopped.set()
    await prober
    return step


async def run_load(
    api_url: str,
    key: str,
    rates: list[float],
    step_s: float,
    max_tokens: int,
    redis_client: redis.Redis,
    stop_p95_ms: float,
) -> list[Step]:
    """Every rate step in turn, on one connection pool; stops after a far-saturated step."""
    from core.queue.routing import waiting_counts

    connector = aiohttp.TCPConnector(limit=CONNECTIONS)
    timeout = aiohttp.ClientTimeout(total=60)
    headers = {"Authorization": f"Bearer {key}"}
    steps = []
    async with aiohttp.ClientSession(
        base_url=api_url, headers=headers, connector=connector, timeout=timeout
    ) as session:
        # Warm-up: the API's caches, connections and the first database writes.
        await run_step(session, api_url, 10, 2.0, max_tokens)
        for rate in rates:
            step = await run_step(session, api_url, rate, step_s, max_tokens)
            step.waiting_after = sum(waiting_counts(redis_client).values())
            steps.append(step)
            s = step.summary()
            print(
                f"{rate:>6g}/s: achieved {s['achieved_rate']:>6}/s, errors {s['errors']}, "
                f"enqueue p50/p95/p99 {s['enqueue_p50_ms']}/{s['enqueue_p95_ms']}/"
                f"{s['enqueue_p99_ms']} ms, /healthz p95 {s['healthz_p95_ms']} ms "
                f"(max {s['healthz_max_ms']}), waiting {step.waiting_after}",
                flush=True,
            )
            if percentile(step.latency_ms, 95) > stop_p95_ms:
                print(f"stopping: p95 past {stop_p95_ms:g} ms", flush=True)
                break
    return steps


def best_sustained(steps: list[Step]) -> Step | None:
    """The highest-rate step that kept up with p95 enqueue latency under the target."""
    good = [s for s in steps if s.sustained and percentile(s.latency_ms, 95) < P95_TARGET_MS]
    return max(good, key=lambda s: s.target_rate, default=None)


def format_table(steps: list[Step]) -> str:
    """One row per step."""
    header = (
        "rate/s",
        "achieved/s",
        "202",
        "errors",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "healthz p50",
        "p95",
        "max",
        "waiting",
    )
    rows = [header]
    for step in steps:
        s = step.summary()
        rows.append(
            (
                f"{step.target_rate:g}",
                f"{s['achieved_rate']:.1f}",
                str(step.accepted),
                str(sum(step.errors.values())),
                f"{s['enqueue_p50_ms']:.1f}",
                f"{s['enqueue_p95_ms']:.1f}",
                f"{s['enqueue_p99_ms']:.1f}",
                f"{s['healthz_p50_ms']:.1f}",
                f"{s['healthz_p95_ms']:.1f}",
                f"{s['healthz_max_ms']:.1f}",
                str(step.waiting_after),
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def save_chart(steps: list[Step], title: str, path: Path) -> None:
    """Enqueue latency percentiles and /healthz latency against the offered rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [s.target_rate for s in steps]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for q, style in ((50, "o-"), (95, "s-"), (99, "^-")):
        left.plot(rates, [percentile(s.latency_ms, q) for s in steps], style, label=f"p{q}")
    left.axhline(P95_TARGET_MS, color="gray", linestyle="--", label="50 ms")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("offered rate, jobs/s")
    left.set_ylabel("POST /v1/jobs → 202, ms")
    left.set_title("Enqueue latency")
    left.legend()
    right.plot(rates, [percentile(s.health_ms, 50) for s in steps], "o-", label="p50")
    right.plot(rates, [percentile(s.health_ms, 95) for s in steps], "s-", label="p95")
    right.plot(rates, [max(s.health_ms, default=0) for s in steps], "^-", label="max")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    for axis in (left, right):
        axis.set_xticks(rates, [f"{rate:g}" for rate in rates])
    right.set_xlabel("offered rate, jobs/s")
    right.set_ylabel("GET /healthz, ms")
    right.set_title("/healthz while submitting")
    right.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    """Run the steps, print the table, save chart and JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_argument(parser)
    parser.add_argument("--rates", default="25,50,100,200,400,800")
    parser.add_argument("--step-s", type=float, default=12.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--worker", action="store_true", help="also run one CPU worker")
    parser.add_argument(
        "--stop-p95-ms", type=float, default=2000.0, help="stop after a step with p95 past this"
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]

    from inferq.local import free_port

    machine = machine_info()
    work_dir = Path(tempfile.mkdtemp(prefix="inferq-load-"))
    model_dir = bench_model(args.model)
    model = model_facts(model_dir)
    settings = bench_settings(work_dir, model_dir)
    env = {"INFERQ_TIERS": json.dumps(HOUR_TIERS)}
    mode = "with one CPU worker" if args.worker else "no worker"
    print(
        f"machine : {machine['cpu_count']} CPUs, {machine['cpu_model']}; {machine['vllm']}\n"
        f"{model_line(model)}\n"
        f"workload: POST /v1/jobs ({args.max_tokens} tokens) at {args.rates} jobs/s, "
        f"{args.step_s:g} s each, open loop; {mode}; /healthz every {HEALTH_PROBE_S:g} s\n",
        flush=True,
    )
    ok = False
    try:
        # The stack's own redis-server, so the jobs waiting after each step can be counted.
        with (
            own_redis(settings) as client,
            running_stack(settings, free_port(), env, worker=args.worker) as (api_url, key, _),
        ):
            steps = asyncio.run(
                run_load(
                    api_url, key, rates, args.step_s, args.max_tokens, client, args.stop_p95_ms
                )
            )
        ok = True
    finally:
        if ok:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            print(f"kept {work_dir} (logs under logs/)", file=sys.stderr)

    best = best_sustained(steps)
    print()
    print(format_table(steps))
    verdict = f"highest sustained rate with p95 enqueue < {P95_TARGET_MS:g} ms: " + (
        f"{best.target_rate:g} jobs/s" if best else "none of the rates tried"
    )
    print(f"\n{verdict} ({mode})")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "load-worker" if args.worker else "load"
    chart = args.out / f"{stem}.png"
    save_chart(
        steps, f"Open-loop POST /v1/jobs, {mode}, {machine['cpu_count']} CPUs — {verdict}", chart
    )
    workload = {
        "rates": rates,
        "step_s": args.step_s,
        "max_tokens": args.max_tokens,
        "worker": args.worker,
        "connections": CONNECTIONS,
        "tiers": HOUR_TIERS,
    }
    write_report(
        args.out / f"{stem}.json",
        chart,
        machine,
        model,
        workload,
        p95_target_ms=P95_TARGET_MS,
        best_sustained_rate=best.target_rate if best else None,
        steps=[step.summary() for step in steps],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
