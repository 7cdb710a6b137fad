"""Tiers and concurrency: TTFT per tier under one mixed load, and throughput against concurrency.

On one local stack, in one run:
- throughput against concurrency: batches of 1, 4, 16, 64, … jobs submitted at once, each
  batch waited out before the next; completion tokens per second from the first job created
  to the last one finished (the system's own timestamps);
- TTFT per tier: the same number of premium, standard and basic jobs submitted together to a
  worker with fewer slots than jobs, so the tiers compete; the time-to-first-token CDF of each.

Run: `.venv/bin/python bench/tiers.py [--levels 1,4,16,64 --jobs-per-tier 48 --max-tokens 64]`.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
from report import (
    add_model_argument,
    bench_model,
    bench_settings,
    machine_info,
    model_facts,
    model_line,
    percentile,
    running_stack,
    write_report,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
FINAL = frozenset({"succeeded", "failed", "cancelled", "timed_out"})
TIERS = ("premium", "standard", "basic")


async def _run_batch(
    session: aiohttp.ClientSession, key: str, count: int, max_tokens: int, tag: str
) -> list[dict[str, Any]]:
    """Submit `count` jobs in one request with `key`, then long-poll each until final."""
    body = {
        "jobs": [
            {"prompt": f"{tag} {i}.", "max_tokens": max_tokens, "ignore_eos": True}
            for i in range(count)
        ]
    }
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post("/v1/jobs/batch", json=body, headers=headers) as response:
        if response.status != 202:
            raise RuntimeError(f"POST /v1/jobs/batch answered {response.status}")
        jobs = (await response.json())["data"]

    async def wait(job_id: str) -> dict[str, Any]:
        while True:
            async with session.get(
                f"/v1/jobs/{job_id}", params={"wait": 30}, headers=headers
            ) as response:
                job: dict[str, Any] = await response.json()
            if job["status"] in FINAL:
                return job

    return list(await asyncio.gather(*(wait(job["id"]) for job in jobs)))


def _span_tokens_per_s(jobs: list[dict[str, Any]]) -> float:
    ok = [job for job in jobs if job["status"] == "succeeded"]
    created = [datetime.fromisoformat(job["created_at"]).timestamp() for job in ok]
    finished = [c + job["timings"]["total_s"] for c, job in zip(created, ok, strict=True)]
    span = max(finished) - min(created)
    return sum(job["usage"]["completion_tokens"] for job in ok) / span if span > 0 else 0.0


async def sweep(api_url: str, key: str, levels: list[int], max_tokens: int) -> dict[int, float]:
    """Tokens/s at each concurrency level."""
    async with aiohttp.ClientSession(base_url=api_url) as session:
        await _run_batch(session, key, 2, 8, "warm-up")
        return {
            level: _span_tokens_per_s(
                await _run_batch(session, key, level, max_tokens, f"level {level}")
            )
            for level in levels
        }


async def mixed(
    api_url: str, keys: dict[str, str], per_tier: int, max_tokens: int
) -> dict[str, list[float]]:
    """TTFT (s) of every job of each tier, all tiers submitted at the same moment."""
    async with aiohttp.ClientSession(base_url=api_url) as session:
        results = await asyncio.gather(
            *(_run_batch(session, keys[tier], per_tier, max_tokens, tier) for tier in TIERS)
        )
    return {
        tier: [job["timings"]["ttft_s"] for job in jobs if job["timings"]["ttft_s"] is not None]
        for tier, jobs in zip(TIERS, results, strict=True)
    }


def save_chart(throughput: dict[int, float], ttft: dict[str, list[float]], path: Path) -> None:
    """Throughput against concurrency, and the TTFT CDF of each tier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    levels = sorted(throughput)
    left.plot(levels, [throughput[level] for level in levels], marker="o")
    left.set_xscale("log", base=2)
    left.set_xlabel("jobs submitted at once")
    left.set_ylabel("completion tokens / s")
    left.set_title("Throughput against concurrency")
    for tier in TIERS:
        ordered = sorted(ttft[tier])
        if ordered:
            fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
            right.plot(ordered, fractions, label=tier)
    right.set_xlabel("time to first token, s")
    right.set_ylabel("fraction of jobs")
    right.set_title("TTFT per tier, all tiers at once")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and the mixed load on one stack; print tables, save chart and JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_argument(parser)
    parser.add_argument("--levels", default="1,4,16,64")
    parser.add_argument("--jobs-per-tier", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--worker-concurrency", type=int, default=32)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    levels = [int(level) for level in args.levels.split(",")]

    from core.apikeys import KeyStore
    from core.db import Database
    from core.tiers import Tier
    from inferq.local import free_port

    machine = machine_info()
    work_dir = Path(tempfile.mkdtemp(prefix="inferq-bench-"))
    model_dir = bench_model(args.model)
    model = model_facts(model_dir)
    settings = bench_settings(work_dir, model_dir)
    print(
        f"machine : {machine['cpu_count']} CPUs, {machine['cpu_model']}; {machine['vllm']}\n"
        f"{model_line(model)}\n"
        f"workload: concurrency {levels} x {args.max_tokens} tokens; then "
        f"{args.jobs_per_tier} jobs per tier at once, worker concurrency "
        f"{args.worker_concurrency}\n",
        flush=True,
    )
    env = {"INFERQ_WORKER_CONCURRENCY": str(args.worker_concurrency)}
    with running_stack(settings, free_port(), env) as (api_url, key, _):
        store = KeyStore(Database(settings.sqlalchemy_url))
        keys = {tier: store.create(f"bench-{tier}", Tier(tier))[0] for tier in TIERS}
        throughput = asyncio.run(sweep(api_url, key, levels, args.max_tokens))
        ttft = asyncio.run(mixed(api_url, keys, args.jobs_per_tier, args.max_tokens))
    shutil.rmtree(work_dir, ignore_errors=True)

    print(f"{'jobs at once':>12}  {'tokens/s':>9}")
    for level in levels:
        print(f"{level:>12}  {throughput[level]:>9.1f}")
    print(f"\n{'tier':<9}{'jobs':>5}{'TTFT p50 s':>12}{'p95 s':>8}")
    for tier in TIERS:
        values = ttft[tier]
        p50, p95 = percentile(values, 50), percentile(values, 95)
        print(f"{tier:<9}{len(values):>5}{p50:>12.2f}{p95:>8.2f}")

    args.out.mkdir(parents=True, exist_ok=True)
    chart = args.out / "tiers.png"
    save_chart(throughput, ttft, chart)
    workload = {
        "levels": levels,
        "jobs_per_tier": args.jobs_per_tier,
        "max_tokens": args.max_tokens,
        "worker_concurrency": args.worker_concurrency,
    }
    write_report(
        args.out / "tiers.json",
        chart,
        machine,
        model,
        workload,
        tokens_per_s_by_concurrency={str(k): round(v, 1) for k, v in throughput.items()},
        ttft_s_by_tier={
            tier: {"p50": round(percentile(v, 50), 3), "p95": round(percentile(v, 95), 3)}
            for tier, v in ttft.items()
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
