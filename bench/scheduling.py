"""Merging and tiers: what identical work and a saturated basic queue cost.

In one run:
- (a) document Q&A with repeats: one document, `--questions` questions of which 30% repeat an
  earlier one, all deterministic (temperature 0), submitted as one batch; completion time (first
  job created → last finished) with request merging on and off, each on its own fresh stack
  with the result cache off, so only merging differs;
- (b) premium time-to-first-token: `--premium` premium jobs submitted one every 0.25 s, first on
  an idle stack, then while `--basic` basic jobs keep the worker saturated; TTFT p50/p95 of each.

Run: `.venv/bin/python bench/scheduling.py [--questions 100 --premium 24 --basic 400]`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
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


async def _wait(session: aiohttp.ClientSession, key: str, job_id: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    while True:
        async with session.get(f"/v1/jobs/{job_id}", params={"wait": 30}, headers=headers) as r:
            job: dict[str, Any] = await r.json()
        if job["status"] in FINAL:
            return job


async def _batch(
    session: aiohttp.ClientSession, key: str, jobs: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post("/v1/jobs/batch", json={"jobs": jobs}, headers=headers) as response:
        if response.status != 202:
            raise RuntimeError(f"POST /v1/jobs/batch answered {response.status}")
        created: list[dict[str, Any]] = (await response.json())["data"]
    return created


def _span_s(jobs: list[dict[str, Any]]) -> float:
    created = min(datetime.fromisoformat(job["created_at"]) for job in jobs)
    finished = max(
        datetime.fromisoformat(job["created_at"]).timestamp() + job["timings"]["total_s"]
        for job in jobs
    )
    return finished - created.timestamp()


def qa_workload(questions: int, repeat_share: float, seed: int = 7) -> list[str]:
    """Prompts: one document, then each question; `repeat_share` of them repeat earlier ones."""
    document = " ".join(
        f"Section {i}: the tenant pays rent on day {i % 28 + 1}." for i in range(40)
    )
    rng = random.Random(seed)
    asked: list[str] = []
    for i in range(questions):
        if asked and rng.random() < repeat_share:
            asked.append(rng.choice(asked))
        else:
            asked.append(f"Question {i}: when is rent due under section {i % 40}?")
    return [f"{document}\n\n{question}\nAnswer:" for question in asked]


async def qa_run(api_url: str, key: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """Submit the Q&A batch at once and wait for every answer."""
    async with aiohttp.ClientSession(base_url=api_url) as session:
        jobs = await _batch(
            session,
            key,
            [{"prompt": p, "max_tokens": max_tokens, "temperature": 0} for p in prompts],
        )
        done = await asyncio.gather(*(_wait(session, key, job["id"]) for job in jobs))
    served = [job["served_from"] for job in done]
    return {
        "seconds": _span_s(done),
        "merged": served.count("merged"),
        "succeeded": sum(job["status"] == "succeeded" for job in done),
    }


async def premium_ttft(
    api_url: str, premium: str, basic: str, count: int, basic_jobs: int, max_tokens: int
) -> dict[str, list[float]]:
    """TTFT of premium jobs posted one every 0.25 s: idle, then behind a basic flood."""
    results: dict[str, list[float]] = {}
    async with aiohttp.ClientSession(base_url=api_url) as session:
        for label, flood in (("idle", 0), ("basic saturated", basic_jobs)):
            background: list[dict[str, Any]] = []
            if flood:
                background = await _batch(
                    session,
                    basic,
                    [
                        {"prompt": f"Basic {i}.", "max_tokens": max_tokens, "ignore_eos": True}
                        for i in range(flood)
                    ],
                )
                await asyncio.sleep(2)  # the worker is full and the basic queue deep
            jobs = []
            for i in range(count):
                jobs += await _batch(
                    session, premium, [{"prompt": f"Premium {label} {i}.", "max_tokens": 16}]
                )
                await asyncio.sleep(0.25)
            done = await asyncio.gather(*(_wait(session, premium, job["id"]) for job in jobs))
            results[label] = [job["timings"]["ttft_s"] for job in done if job["timings"]["ttft_s"]]
            await asyncio.gather(*(_wait(session, basic, job["id"]) for job in background))
    return results


def save_chart(qa: dict[str, dict[str, Any]], ttft: dict[str, list[float]], path: Path) -> None:
    """Bars: Q&A completion time with merging on/off; premium TTFT p50/p95 idle vs saturated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.bar(list(qa), [run["seconds"] for run in qa.values()], color=["tab:green", "tab:gray"])
    left.set_ylabel("seconds to answer every question")
    left.set_title("document Q&A, 30% repeated questions")
    labels = list(ttft)
    width = 0.35
    for offset, q in ((-width / 2, 50), (width / 2, 95)):
        right.bar(
            [i + offset for i in range(len(labels))],
            [percentile(ttft[label], q) for label in labels],
            width,
            label=f"p{q}",
        )
    right.set_xticks(range(len(labels)), labels)
    right.set_ylabel("premium time to first token (s)")
    right.set_title("premium TTFT")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """Run (a) on two stacks and (b) on the first; print tables, save chart and JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_argument(parser)
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--repeat-share", type=float, default=0.3)
    parser.add_argument("--qa-max-tokens", type=int, default=64)
    parser.add_argument("--premium", type=int, default=24)
    parser.add_argument("--basic", type=int, default=400)
    parser.add_argument("--basic-max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)

    from core.apikeys import KeyStore
    from core.db import Database
    from core.tiers import Tier
    from inferq.local import free_port

    machine = machine_info()
    work_root = Path(tempfile.mkdtemp(prefix="inferq-bench-"))
    model_dir = bench_model(args.model)
    model = model_facts(model_dir)
    prompts = qa_workload(args.questions, args.repeat_share)
    distinct = len(set(prompts))
    print(
        f"machine : {machine['cpu_count']} CPUs, {machine['cpu_model']}; {machine['vllm']}\n"
        f"{model_line(model)}\n"
        f"workload: (a) {len(prompts)} questions on one document ({distinct} distinct) x "
        f"{args.qa_max_tokens} tokens, temperature 0; (b) {args.premium} premium jobs, "
        f"basic flood of {args.basic} x {args.basic_max_tokens} tokens\n",
        flush=True,
    )
    qa: dict[str, dict[str, Any]] = {}
    ttft: dict[str, list[float]] = {}
    for label, merge in (("merging on", "true"), ("merging off", "false")):
        settings = bench_settings(work_root / label.replace(" ", "-"), model_dir)
        env = {"INFERQ_MERGE_REQUESTS": merge, "INFERQ_RESULT_CACHE_TTL_S": "0"}
        with running_stack(settings, free_port(), env) as (api_url, key, _):
            qa[label] = asyncio.run(qa_run(api_url, key, prompts, args.qa_max_tokens))
            print(f"{label}: {qa[label]}", flush=True)
            if merge == "true":
                basic = KeyStore(Database(settings.sqlalchemy_url)).create("basic", Tier.BASIC)[0]
                ttft = asyncio.run(
                    premium_ttft(
                        api_url, key, basic, args.premium, args.basic, args.basic_max_tokens
                    )
                )
    shutil.rmtree(work_root, ignore_errors=True)

    ratio = qa["merging on"]["seconds"] / qa["merging off"]["seconds"]
    print(f"\n{'document Q&A':<14}{'seconds':>9}{'merged jobs':>13}")
    for label, run in qa.items():
        print(f"{label:<14}{run['seconds']:>9.1f}{run['merged']:>13}")
    print(f"completion-time ratio on/off: {ratio:.2f}")
    print(f"\n{'premium TTFT':<18}{'p50 s':>7}{'p95 s':>7}")
    for label, values in ttft.items():
        print(f"{label:<18}{percentile(values, 50):>7.2f}{percentile(values, 95):>7.2f}")

    args.out.mkdir(parents=True, exist_ok=True)
    chart = args.out / "scheduling.png"
    save_chart(qa, ttft, chart)
    write_report(
        args.out / "scheduling.json",
        chart,
        machine,
        model,
        vars(args) | {"out": str(args.out), "distinct_questions": distinct},
        qa=qa | {"ratio_on_off": round(ratio, 3)},
        premium_ttft_s={
            label: {"p50": round(percentile(v, 50), 3), "p95": round(percentile(v, 95), 3)}
            for label, v in ttft.items()
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
