"""JSON against MessagePack on a 1,000-question document Q&A batch.

In one run on one local stack: the batch is created once as JSON and once as MessagePack,
each on an idle stack (request size, client encode time, POST latency: the API validates,
stores and enqueues 1,000 jobs); once every answer is in, the batch with its 1,000 answers is
read `--reads` times in each format, the formats taking turns (response size, GET latency as
the client sees it, client decode time).

Run: `.venv/bin/python bench/serialization.py [--questions 1000 --reads 20]`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
from report import (
    add_model_argument,
    bench_model,
    bench_settings,
    machine_info,
    model_facts,
    model_line,
    running_stack,
    write_report,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
MSGPACK = "application/x-msgpack"
FORMATS = ("json", "msgpack")


def _encode(fmt: str, body: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    if fmt == "json":
        return json.dumps(body).encode(), {"Content-Type": "application/json"}
    return msgpack.packb(body), {"Content-Type": MSGPACK, "Accept": MSGPACK}


def _decode(fmt: str, content: bytes) -> Any:
    return json.loads(content) if fmt == "json" else msgpack.unpackb(content)


def _ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1000, 2)


def measure(client: httpx.Client, questions: int, reads: int, max_tokens: int) -> dict[str, Any]:
    """Create one batch per format, wait for the answers, read them back `reads` times each."""
    document = " ".join(f"Clause {i}: the tenant pays rent on day {i % 28 + 1}." for i in range(60))
    body = {
        "document": document,
        "questions": [
            f"Question {i}: when is rent due under clause {i % 60}?" for i in range(questions)
        ],
        "max_tokens": max_tokens,
    }
    results: dict[str, Any] = {}
    ids: dict[str, str] = {}
    for fmt in FORMATS:
        started = time.perf_counter()
        payload, headers = _encode(fmt, body)
        encoded_s = time.perf_counter() - started
        started = time.perf_counter()
        response = client.post("/v1/qa-batches", content=payload, headers=headers)
        post_s = time.perf_counter() - started
        if response.status_code != 202:
            raise SystemExit(f"POST /v1/qa-batches ({fmt}) answered {response.status_code}")
        ids[fmt] = _decode(fmt, response.content)["id"]
        results[fmt] = {
            "request_bytes": len(payload),
            "encode_ms": round(encoded_s * 1000, 2),
            "post_s": round(post_s, 3),
        }
        # The next POST starts on an idle stack, as this one did.
        path = f"/v1/qa-batches/{ids[fmt]}?answers=false"
        while client.get(path).json()["status"] != "completed":
            time.sleep(1)
    gets: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
    decodes: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
    for _ in range(reads):  # the formats take turns, so both see the same machine
        for fmt in FORMATS:
            headers = {"Accept": MSGPACK if fmt == "msgpack" else "application/json"}
            started = time.perf_counter()
            response = client.get(f"/v1/qa-batches/{ids[fmt]}", headers=headers)
            gets[fmt].append(time.perf_counter() - started)
            started = time.perf_counter()
            answers = _decode(fmt, response.content)["answers"]
            decodes[fmt].append(time.perf_counter() - started)
            assert len(answers) == questions
            results[fmt]["response_bytes"] = len(response.content)
    for fmt in FORMATS:
        results[fmt] |= {"get_ms": _ms(gets[fmt]), "decode_ms": _ms(decodes[fmt])}
    return results


def save_chart(results: dict[str, Any], path: Path) -> None:
    """Bars: response size and GET latency of the 1,000-answer batch, per format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    colors = ["tab:blue", "tab:orange"]
    left.bar(FORMATS, [results[f]["response_bytes"] / 1024 for f in FORMATS], color=colors)
    left.set_ylabel("KiB")
    left.set_title("batch with every answer: size")
    right.bar(FORMATS, [results[f]["get_ms"] for f in FORMATS], color=colors)
    right.set_ylabel("ms (median)")
    right.set_title("GET latency, client-side")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """Run on a fresh local stack; print the table, save chart and JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_argument(parser)
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument("--reads", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=16)
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
    print(
        f"machine : {machine['cpu_count']} CPUs, {machine['cpu_model']}; {machine['vllm']}\n"
        f"{model_line(model)}\n"
        f"workload: one document x {args.questions} questions, {args.max_tokens} tokens each; "
        f"{args.reads} reads per format\n",
        flush=True,
    )
    with running_stack(settings, free_port(), {"INFERQ_RESULT_CACHE_TTL_S": "0"}) as (url, _, _):
        key = KeyStore(Database(settings.sqlalchemy_url)).create("bench", Tier.BASIC)[0]
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
            results = measure(client, args.questions, args.reads, args.max_tokens)
    shutil.rmtree(work_dir, ignore_errors=True)

    print(f"{'format':<9}{'req KiB':>9}{'POST s':>8}{'resp KiB':>10}{'GET ms':>8}{'decode ms':>11}")
    for fmt, r in results.items():
        print(
            f"{fmt:<9}{r['request_bytes'] / 1024:>9.1f}{r['post_s']:>8.2f}"
            f"{r['response_bytes'] / 1024:>10.1f}{r['get_ms']:>8.1f}{r['decode_ms']:>11.2f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    chart = args.out / "serialization.png"
    save_chart(results, chart)
    workload = vars(args) | {"out": str(args.out)}
    write_report(args.out / "serialization.json", chart, machine, model, workload, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
