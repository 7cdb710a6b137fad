"""Document Q&A: inferq against vLLM's own OpenAI server, the same 200 questions, one run.

1. inferq (a local stack: own redis-server, SQLite, one CPU worker, the scheduler, the API):
   one `POST /v1/qa-batches` with the document and `--questions` questions; wall time from the
   POST to the last answer seen by the client, and each question's time to first token
   (`timings.ttft_s`: submission to first token, on the server's clock).
2. vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`, the same install and
   model, on the worker's engine arguments): the same prompts as concurrent streaming
   `/v1/completions` requests; wall time from the first request to the last answer, time to
   first token = request sent to first text chunk received.

Same prompts on both (inferq's default Q&A system prompt and template, rendered as inferq renders
them: with the model's chat template, or its fallback for a model without one), same sampling:
temperature 0, at most `--max-tokens` tokens.
Run: `.venv/bin/python bench/qa_vs_vllm.py [--model tiny|real --questions 200 --max-tokens 32]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
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
from vllm_server import vllm_server

from api.openai.chat_prompt import render_chat
from api.qa_batches import DEFAULT_SYSTEM, DEFAULT_TEMPLATE
from core.modelinfo import ModelInfo, load_model_info
from core.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[1]


def workload(questions: int) -> tuple[str, list[str]]:
    """One document (about 3,000 characters) and the questions about it."""
    document = " ".join(f"Clause {i}: the tenant pays rent on day {i % 28 + 1}." for i in range(70))
    return document, [f"When is rent due under clause {i % 70}? ({i})" for i in range(questions)]


def run_inferq(
    api_url: str, key: str, document: str, asked: list[str], tokens: int
) -> dict[str, Any]:
    """One Q&A batch; wall time and per-question TTFT."""
    headers = {"Authorization": f"Bearer {key}"}
    body = {"document": document, "questions": asked, "max_tokens": tokens, "temperature": 0}
    with httpx.Client(base_url=api_url, headers=headers, timeout=120) as client:
        started = time.perf_counter()
        response = client.post("/v1/qa-batches", json=body)
        if response.status_code != 202:
            raise SystemExit(
                f"POST /v1/qa-batches answered {response.status_code}: {response.text}"
            )
        batch_id = response.json()["id"]
        while True:
            batch = client.get(f"/v1/qa-batches/{batch_id}", params={"answers": "false"}).json()
            if batch["status"] == "completed":
                break
            time.sleep(0.05)
        wall_s = time.perf_counter() - started
        answers = client.get(f"/v1/qa-batches/{batch_id}").json()["answers"]
        ttfts = []
        for answer in answers:
            job = client.get(f"/v1/jobs/{answer['job_id']}").json()
            if job["timings"]["ttft_s"] is not None:
                ttfts.append(job["timings"]["ttft_s"])
    succeeded = sum(a["status"] == "succeeded" for a in answers)
    cached = sum(bool(a["cached_prompt_tokens"]) for a in answers)
    return {"wall_s": wall_s, "ttft_s": ttfts, "succeeded": succeeded, "with_cached_prefix": cached}


def prompt_of(model: ModelInfo, document: str, question: str) -> str:
    """The prompt inferq's Q&A batch makes of one question, by default."""
    text = DEFAULT_TEMPLATE.replace("{document}", document).replace("{question}", question)
    system, user = {"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": text}
    return render_chat(model, [system, user])


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
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=len(prompts))
    async with aiohttp.ClientSession(url, timeout=timeout, connector=connector) as session:
        started = time.perf_counter()
        results = await asyncio.gather(*(_stream_one(session, model, p, tokens) for p in prompts))
    return {
        "wall_s": max(done for _, done in results) - started,
        "ttft_s": [ttft for ttft, _ in results],
        "succeeded": len(results),
    }


def run_vllm_server(
    settings: Settings, prompts: list[str], tokens: int, port: int, log: Path
) -> dict[str, Any]:
    """Start vLLM's OpenAI server as inferq's worker runs the engine, send every prompt at once,
    stop it."""
    with vllm_server(settings, port, log) as (url, _pid):
        return asyncio.run(_drive_vllm(url, settings.model_name, prompts, tokens))


def save_chart(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Bars: wall time; TTFT p50 and p95; for both systems."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = list(results)
    left.bar(labels, [r["wall_s"] for r in results.values()], color=["tab:green", "tab:gray"])
    left.set_ylabel("seconds, first request to last answer")
    left.set_title("document Q&A: wall time")
    width = 0.35
    for offset, q in ((-width / 2, 50), (width / 2, 95)):
        right.bar(
            [i + offset for i in range(len(labels))],
            [percentile(results[label]["ttft_s"], q) for label in labels],
            width,
            label=f"p{q}",
        )
    right.set_xticks(range(len(labels)), labels)
    right.set_ylabel("time to first token (s)")
    right.set_title("TTFT")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """Run both, print the table, save chart and JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_argument(parser)
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=32)
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
    document, asked = workload(args.questions)
    info = load_model_info(settings.model_path, None)
    prompts = [prompt_of(info, document, question) for question in asked]
    print(
        f"machine : {machine['cpu_count']} CPUs, {machine['cpu_model']}; {machine['vllm']}\n"
        f"{model_line(model)}\n"
        f"workload: one document ({len(document)} chars) x {args.questions} questions, "
        f"{args.max_tokens} tokens each, temperature 0\n",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    with running_stack(settings, free_port(), {"INFERQ_RESULT_CACHE_TTL_S": "0"}) as (url, _, _):
        key = KeyStore(Database(settings.sqlalchemy_url)).create("bench", Tier.BASIC)[0]
        results["inferq"] = run_inferq(url, key, document, asked, args.max_tokens)
    print(f"inferq: {results['inferq']['wall_s']:.2f} s", flush=True)
    results["vLLM server"] = run_vllm_server(
        settings, prompts, args.max_tokens, free_port(), work_dir / "vllm-server.log"
    )
    print(f"vLLM server: {results['vLLM server']['wall_s']:.2f} s", flush=True)
    shutil.rmtree(work_dir, ignore_errors=True)

    ratio = results["inferq"]["wall_s"] / results["vLLM server"]["wall_s"]
    print(f"\n{'system':<13}{'wall s':>8}{'TTFT p50 s':>12}{'TTFT p95 s':>12}{'answered':>10}")
    for label, r in results.items():
        print(
            f"{label:<13}{r['wall_s']:>8.2f}{percentile(r['ttft_s'], 50):>12.2f}"
            f"{percentile(r['ttft_s'], 95):>12.2f}{r['succeeded']:>10}"
        )
    print(f"wall-time ratio inferq / vLLM server: {ratio:.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    chart = args.out / "qa_vs_vllm.png"
    save_chart(results, chart)
    write_report(
        args.out / "qa_vs_vllm.json",
        chart,
        machine,
        model,
        vars(args) | {"out": str(args.out), "document_chars": len(document)},
        results={
            label: {
                "wall_s": round(r["wall_s"], 3),
                "ttft_p50_s": round(percentile(r["ttft_s"], 50), 3),
                "ttft_p95_s": round(percentile(r["ttft_s"], 95), 3),
                "succeeded": r["succeeded"],
            }
            for label, r in results.items()
        }
        | {"ratio_inferq_over_vllm": round(ratio, 3)},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
