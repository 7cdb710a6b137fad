"""Document Q&A: inferq against vLLM's own OpenAI server, side by side, in paired rounds.

The workload: one document of about `--document-tokens` tokens and `--questions` questions
about it, `--repeat-share` of them asking again a question asked earlier in the list (at a
random later place, from a fixed seed), temperature 0, at most `--max-tokens` tokens each.
Every round runs three ways in turn, each on a document of its own (so no run finds another's
prefix or result in a cache):

1. inferq (a local stack: own redis-server, SQLite, one CPU worker, the scheduler, the API):
   one `POST /v1/qa-batches` with every question; wall time from the POST to the client seeing
   the batch completed (it asks every 0.2 s); each question's time to first token
   (`timings.ttft_s`: submission to first token, on the server's clock), and how many answers
   shared another's engine run.
2. vLLM's OpenAI server with every question (`python -m vllm.entrypoints.openai.api_server`,
   the same install and model, on the worker's engine arguments, prefix caching on): every
   prompt as a concurrent streaming `/v1/completions` request; wall time from the first request
   to the last answer; time to first token = request sent to first text chunk received.
3. vLLM's server given only the distinct questions: what a careful client could do.

Both systems stay up side by side for all rounds, after a warm-up batch through each (a tenth
of the questions, not counted); while one runs, the other's processes are
stopped (SIGSTOP), so an idle engine's loop takes nothing from it. The CPU seconds of each
system's processes are noted per role; those besides the engine core, per question, are its
serving cost. Same prompts on both (inferq's default Q&A
system prompt and template, rendered as inferq renders them), same sampling. Ratios are paired
per round (inferq's wall time over each vLLM run's in the same round), then the median.
Run: `.venv/bin/python bench/qa_vs_vllm.py [--model real|tiny --questions 500 --rounds 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from report import (
    add_model_argument,
    bench_model,
    bench_settings,
    cpu_use,
    descendants,
    machine_info,
    model_facts,
    model_line,
    paused,
    percentile,
    running_stack,
    write_report,
)
from vllm_server import vllm_server

from api.qa_batches import QaBatchCreate
from core.modelinfo import ModelInfo, load_model_info

REPO_ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("inferq", "vLLM, every question", "vLLM, distinct questions")
ADMISSION_WINDOW_S = 65
"""How long the API's admission control goes by the rates of past work (six 10-s buckets)."""
POLL_S = 0.2
"""How often the client asks whether the batch is complete (the CLI asks every second)."""


def document_of(model: ModelInfo, tokens: int) -> str:
    """A lease of about `tokens` tokens, with a name of its own."""
    name = uuid.uuid4().hex[:8]
    clauses: list[str] = []
    while not clauses or model.count_tokens(" ".join(clauses)) < tokens:
        i = len(clauses)
        clauses.append(
            f"Clause {i} of lease {name}: the tenant pays rent on day {i % 28 + 1}, "
            f"keeps {i % 5 + 1} parking spaces and gives {i % 3 + 1} months' notice."
        )
    return " ".join(clauses)


def questions_of(count: int, repeat_share: float, seed: int) -> list[str]:
    """`count` questions, `repeat_share` of them repeating an earlier one at a later place."""
    rng = random.Random(seed)
    repeats = round(count * repeat_share)
    asked = [
        f"Question {i}: under clause {i % 40}, when is rent due?" for i in range(count - repeats)
    ]
    for _ in range(repeats):
        original = rng.randrange(len(asked))
        asked.insert(rng.randrange(original + 1, len(asked) + 1), asked[original])
    return asked


def prompt_of(model: ModelInfo, document: str, question: str) -> str:
    """The prompt inferq's Q&A batch makes of one question, by default."""
    batch = QaBatchCreate(document=document, questions=[question])
    return batch.rendered(model, document, question)


def run_inferq(
    client: httpx.Client, document: str, asked: list[str], tokens: int
) -> dict[str, Any]:
    """One Q&A batch, polled every `POLL_S` until complete; its id and wall time."""
    body = {"document": document, "questions": asked, "max_tokens": tokens, "temperature": 0}
    started = time.perf_counter()
    response = client.post("/v1/qa-batches", json=body)
    if response.status_code != 202:
        raise SystemExit(f"POST /v1/qa-batches answered {response.status_code}: {response.text}")
    batch_id = response.json()["id"]
    while True:
        batch = client.get(f"/v1/qa-batches/{batch_id}", params={"answers": "false"}).json()
        if batch["status"] == "completed":
            break
        time.sleep(POLL_S)
    return {"batch_id": batch_id, "wall_s": time.perf_counter() - started}


def inferq_answers(client: httpx.Client, batch_id: str) -> dict[str, Any]:
    """Per-question TTFT and how many answers shared another's engine run (read afterwards)."""
    answers = client.get(f"/v1/qa-batches/{batch_id}").json()["answers"]
    jobs = [client.get(f"/v1/jobs/{answer['job_id']}").json() for answer in answers]
    return {
        "ttft_s": [job["timings"]["ttft_s"] for job in jobs if job["timings"]["ttft_s"]],
        "succeeded": sum(job["status"] == "succeeded" for job in jobs),
        "shared_run": sum(job["served_from"] in ("merged", "cache") for job in jobs),
    }


async def _stream_one(
    session: aiohttp.ClientSession, model: str, prompt: str, tokens: int
) -> tuple[float, float]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    sent = time.perf_counter()
    first = 0.0
    async with session.post("/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if first or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter()
    return (first or time.perf_counter()) - sent, time.perf_counter()


async def _drive_vllm(url: str, model: str, prompts: list[str], tokens: int) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=1800)
    connector = aiohttp.TCPConnector(limit=len(prompts))
    async with aiohttp.ClientSession(url, timeout=timeout, connector=connector) as session:
        started = time.perf_counter()
        results = await asyncio.gather(*(_stream_one(session, model, p, tokens) for p in prompts))
    return {
        "wall_s": max(done for _, done in results) - started,
        "ttft_s": [ttft for ttft, _ in results],
        "succeeded": len(results),
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A system's figures over the rounds: wall times, median, TTFT of every question."""
    ttfts = [t for run in runs for t in run["ttft_s"]]
    figures = {
        "wall_s": [round(run["wall_s"], 3) for run in runs],
        "wall_median_s": round(statistics.median(run["wall_s"] for run in runs), 3),
        "ttft_p50_s": round(percentile(ttfts, 50), 3),
        "ttft_p95_s": round(percentile(ttfts, 95), 3),
        "succeeded": [run["succeeded"] for run in runs],
    }
    if "shared_run" in runs[0]:
        figures["shared_run"] = [run["shared_run"] for run in runs]
    # CPU seconds of each process role, and those besides the engine core per question asked.
    figures["cpu_s"] = [run["cpu_s"] for run in runs]
    serving = [sum(s for role, s in run["cpu_s"].items() if role != "engine core") for run in runs]
    asked = int(runs[0]["succeeded"])
    figures["serving_cpu_ms_per_question"] = round(1000 * statistics.median(serving) / asked, 2)
    return figures


def save_chart(results: dict[str, Any], ratios: dict[str, list[float]], path: Path) -> None:
    """Bars: median wall time per system; points: inferq's paired ratio per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(
        [label.replace(", ", "\n") for label in SYSTEMS],
        [results[label]["wall_median_s"] for label in SYSTEMS],
        color=["tab:green", "tab:gray", "tab:olive"],
    )
    left.set_ylabel("seconds, first request to last answer (median)")
    left.set_title("document Q&A: wall time")
    for label, values in ratios.items():
        right.plot(range(1, len(values) + 1), values, marker="o", label=f"inferq / {label}")
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_xlabel("round")
    right.set_ylabel("wall-time ratio")
    right.set_title("paired ratios (below 1: inferq faster)")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, print the table, save chart and JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_argument(parser, default="real")
    parser.add_argument("--questions", type=int, default=500)
    parser.add_argument("--repeat-share", type=float, default=0.3)
    parser.add_argument("--document-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--tier", default="basic", help="the API key's tier (basic: at most 70%% of a worker)"
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)

    from core.apikeys import KeyStore
    from core.db import Database
    from core.tiers import Tier
    from inferq.local import free_port

    machine = machine_info()
    work_dir = Path(tempfile.mkdtemp(prefix="inferq-bench-"))
    model_dir = bench_model(args.model)
    model = model_facts(model_dir)
    settings = bench_settings(work_dir, model_dir)
    info = load_model_info(settings.model_path, None)
    asked = questions_of(args.questions, args.repeat_share, args.seed)
    distinct = list(dict.fromkeys(asked))
    print(
        f"machine : {machine['cpu_count']} CPUs, {machine['cpu_model']}; {machine['vllm']}\n"
        f"{model_line(model)}\n"
        f"workload: one document of ~{args.document_tokens} tokens x {len(asked)} questions "
        f"({len(distinct)} distinct), {args.max_tokens} tokens each, temperature 0; "
        f"{args.rounds} rounds; inferq's key: {args.tier} tier\n",
        flush=True,
    )
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in SYSTEMS}
    before = descendants()
    with running_stack(settings, free_port()) as (url, _, _):
        stack_pids = descendants() - before
        with vllm_server(settings, free_port(), work_dir / "vllm-server.log") as (vllm_url, _):
            server_pids = descendants() - before - stack_pids
            tier = Tier(args.tier)
            key = KeyStore(Database(settings.sqlalchemy_url)).create("bench", tier)[0]
            headers = {"Authorization": f"Bearer {key}"}
            with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
                # A warm-up through both, not counted: each engine's first batches of a size
                # compile kernels.
                warm = asked[: max(len(asked) // 10, 1)]
                run_inferq(client, document_of(info, args.document_tokens), warm, args.max_tokens)
                prompts = [
                    prompt_of(info, document_of(info, args.document_tokens), q) for q in warm
                ]
                asyncio.run(_drive_vllm(vllm_url, settings.model_name, prompts, args.max_tokens))
                # Until the warm-up leaves admission's window, a batch is judged by its rate: a
                # small batch's, which measures the demand, refuses a large one as too slow.
                time.sleep(ADMISSION_WINDOW_S)
                for round_ in range(1, args.rounds + 1):
                    document = document_of(info, args.document_tokens)
                    # Each system has the machine to itself: the other's processes are stopped.
                    with paused(server_pids), cpu_use(stack_pids) as used:
                        run = run_inferq(client, document, asked, args.max_tokens)
                    answers = inferq_answers(client, run["batch_id"])
                    runs["inferq"].append(run | answers | {"cpu_s": used})
                    for label, questions in ((SYSTEMS[1], asked), (SYSTEMS[2], distinct)):
                        document = document_of(info, args.document_tokens)
                        prompts = [prompt_of(info, document, q) for q in questions]
                        with paused(stack_pids), cpu_use(server_pids) as used:
                            run = asyncio.run(
                                _drive_vllm(vllm_url, settings.model_name, prompts, args.max_tokens)
                            )
                        runs[label].append(run | {"cpu_s": used})
                    print(
                        f"round {round_}: "
                        + ", ".join(
                            f"{label} {runs[label][-1]['wall_s']:.2f} s" for label in SYSTEMS
                        ),
                        flush=True,
                    )
    shutil.rmtree(work_dir, ignore_errors=True)

    results = {label: summary(runs[label]) for label in SYSTEMS}
    # A round in which some of inferq's questions failed or timed out is no comparison: its
    # wall time is the time to give up on them, not to answer them.
    whole = [run["succeeded"] == len(asked) for run in runs["inferq"]]
    if not any(whole):
        print(f"\nno round answered every question: {results['inferq']['succeeded']}")
        return 1
    ratios = {
        label: [
            round(mine["wall_s"] / theirs["wall_s"], 3)
            for mine, theirs, counted in zip(runs["inferq"], runs[label], whole, strict=True)
            if counted
        ]
        for label in SYSTEMS[1:]
    }
    print(
        f"\n{'system':<26}{'wall s (median)':>16}{'TTFT p50 s':>12}{'TTFT p95 s':>12}"
        f"{'serving CPU ms/question':>25}"
    )
    for label, r in results.items():
        print(
            f"{label:<26}{r['wall_median_s']:>16.2f}{r['ttft_p50_s']:>12.2f}{r['ttft_p95_s']:>12.2f}"
            f"{r['serving_cpu_ms_per_question']:>25.2f}"
        )
    for label, values in ratios.items():
        print(f"inferq / {label}: {statistics.median(values):.2f} (rounds: {values})")
    if not all(whole):
        print(f"rounds left out of the ratios, not every question answered: {whole}")
    print(f"answers that shared another's engine run: {results['inferq']['shared_run']}")
    args.out.mkdir(parents=True, exist_ok=True)
    chart = args.out / "qa_vs_vllm.png"
    save_chart(results, ratios, chart)
    write_report(
        args.out / "qa_vs_vllm.json",
        chart,
        machine,
        model,
        vars(args) | {"out": str(args.out), "distinct_questions": len(distinct)},
        results=results,
        ratios={
            label: {"rounds": v, "median": statistics.median(v)} for label, v in ratios.items()
        },
        rounds_counted=whole,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
