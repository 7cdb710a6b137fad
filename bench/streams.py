"""Token streams: generation throughput with and without live SSE readers, and stream latency.

Runs the same jobs twice on one local stack, side by side in one run: once watched by nobody
(clients long-poll for the result), once with one live `GET /v1/jobs/{id}/events` reader per
job. Stream latency is the time from the engine step that made a token (the delta's `at`) to
the moment the SSE client has parsed the event carrying it; events made before their reader
connected are replay, not latency, and are left out.

Run: `.venv/bin/python bench/streams.py [--jobs 64 --max-tokens 256 --out bench/results]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
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
FINAL_EVENTS = frozenset({"done", "error", "cancelled", "timed_out"})
FINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled", "timed_out"})


@dataclass
class StreamRun:
    """What one mode measured."""

    mode: str
    jobs: int
    succeeded: int = 0
    tokens: int = 0
    server_span_s: float = 0.0
    latency_s: list[float] = field(default_factory=list)
    events: int = 0
    deltas_match: bool = True

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens per second from first job created to last job finished."""
        return self.tokens / self.server_span_s if self.server_span_s else 0.0

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures."""
        return {
            "mode": self.mode,
            "jobs": self.jobs,
            "succeeded": self.succeeded,
            "tokens": self.tokens,
            "server_span_s": round(self.server_span_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "stream_events": self.events,
            "stream_latency_p50_ms": round(percentile(self.latency_s, 50) * 1000, 2),
            "stream_latency_p99_ms": round(percentile(self.latency_s, 99) * 1000, 2),
            "streamed_text_equals_stored": self.deltas_match,
        }


async def _read_stream(
    session: aiohttp.ClientSession, job_id: str, run: StreamRun
) -> tuple[str, int]:
    """Follow one job's SSE stream to its final event; returns its text and token count."""
    connected_at = time.time()
    text: list[str] = []
    tokens = 0
    async with session.get(f"/v1/jobs/{job_id}/events") as response:
        response.raise_for_status()
        data = ""
        async for raw in response.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("data: "):
                data = line[6:]
            elif line == "" and data:
                event = json.loads(data)
                data = ""
                run.events += 1
                if event["type"] == "delta":
                    if event["at"] >= connected_at:
                        run.latency_s.append(time.time() - event["at"])
                    text.append(event["text"])
                    tokens += event["tokens"]
                elif event["type"] in FINAL_EVENTS:
                    break
    return "".join(text), tokens


async def _wait_final(session: aiohttp.ClientSession, job_id: str) -> dict[str, Any]:
    while True:
        async with session.get(f"/v1/jobs/{job_id}", params={"wait": 30}) as response:
            response.raise_for_status()
            job: dict[str, Any] = await response.json()
        if job["status"] in FINAL_STATUSES:
            return job


async def _submit_batch(session: aiohttp.ClientSession, body: dict[str, Any]) -> Any:
    """POST the batch; a 429 (admission control) is retried after its Retry-After, as a
    client would."""
    for _ in range(10):
        async with session.post("/v1/jobs/batch", json=body) as response:
            if response.status == 202:
                return (await response.json())["data"]
            if response.status != 429:
                raise RuntimeError(f"POST /v1/jobs/batch answered {response.status}")
            print(f"429, retrying: {(await response.json())['error']['message']}", flush=True)
            await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
    raise RuntimeError("POST /v1/jobs/batch was refused ten times")


async def run_mode(
    api_url: str, key: str, jobs: int, max_tokens: int, *, readers: bool
) -> StreamRun:
    """Submit every job in one batch, then long-poll them (and, with `readers`, stream each)."""
    run = StreamRun(f"{jobs} SSE readers" if readers else "no readers", jobs)
    connector = aiohttp.TCPConnector(limit=2 * jobs + 8)
    timeout = aiohttp.ClientTimeout(total=600)
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(
        base_url=api_url, headers=headers, connector=connector, timeout=timeout
    ) as session:
        body = {
            "jobs": [
                {"prompt": f"Stream {i}.", "max_tokens": max_tokens, "ignore_eos": True}
                for i in range(jobs)
            ]
        }
        submitted = await _submit_batch(session, body)
        streams = (
            asyncio.gather(*(_read_stream(session, job["id"], run) for job in submitted))
            if readers
            else None
        )
        finals = await asyncio.gather(*(_wait_final(session, job["id"]) for job in submitted))
        streamed = await streams if streams is not None else None

    ok = [job for job in finals if job["status"] == "succeeded"]
    run.succeeded = len(ok)
    run.tokens = sum(job["usage"]["completion_tokens"] or 0 for job in ok)
    created = [datetime.fromisoformat(job["created_at"]).timestamp() for job in ok]
    finished = [c + job["timings"]["total_s"] for c, job in zip(created, ok, strict=True)]
    run.server_span_s = max(finished) - min(created) if ok else 0.0
    if streamed is not None:
        run.deltas_match = all(
            text == job["text"] for (text, _), job in zip(streamed, finals, strict=True)
        )
    return run


def save_chart(runs: list[StreamRun], title: str, path: Path) -> None:
    """Throughput bars for both modes, and the CDF of stream latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = ["#4c72b0", "#dd8452"]
    bars = left.bar([r.mode for r in runs], [r.tokens_per_s for r in runs], color=colors)
    left.bar_label(bars, fmt="%.0f")
    left.set_ylabel("completion tokens / s")
    left.set_title("Generation throughput")
    for run in runs:
        if run.latency_s:
            ordered = sorted(ms * 1000 for ms in run.latency_s)
            fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
            right.plot(ordered, fractions, label=run.mode)
    right.set_xscale("log")
    right.set_xlabel("token made → received by the SSE client, ms")
    right.set_ylabel("fraction of stream events")
    right.set_title("Stream latency (CDF)")
    right.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    """Run both modes on one stack, print the table, save the chart and the JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_argument(parser)
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)

    from inferq.local import free_port

    machine = machine_info()
    work_dir = Path(tempfile.mkdtemp(prefix="inferq-bench-"))
    model_dir = bench_model(args.model)
    model = model_facts(model_dir)
    settings = bench_settings(work_dir, model_dir)
    print(
        f"machine : {machine['cpu_count']} CPUs, {machine['cpu_model']}; {machine['vllm']}\n"
        f"{model_line(model)}\n"
        f"workload: {args.jobs} jobs x {args.max_tokens} tokens, ignore_eos, one batch POST\n",
        flush=True,
    )
    with running_stack(settings, free_port()) as (api_url, key, _):
        warm = asyncio.run(run_mode(api_url, key, 4, 8, readers=True))
        assert warm.succeeded == 4, "warm-up failed"
        runs = [
            asyncio.run(run_mode(api_url, key, args.jobs, args.max_tokens, readers=False)),
            asyncio.run(run_mode(api_url, key, args.jobs, args.max_tokens, readers=True)),
        ]
    shutil.rmtree(work_dir, ignore_errors=True)

    quiet, watched = runs
    ratio = watched.tokens_per_s / quiet.tokens_per_s if quiet.tokens_per_s else float("nan")
    print(f"{'mode':<16}{'jobs':>6}{'tokens/s':>11}{'events':>8}{'lat p50 ms':>12}{'p99 ms':>9}")
    for run in runs:
        summary = run.summary()
        print(
            f"{run.mode:<16}{run.succeeded:>6}{run.tokens_per_s:>11.1f}{run.events:>8}"
            f"{summary['stream_latency_p50_ms']:>12.1f}{summary['stream_latency_p99_ms']:>9.1f}"
        )
    match = watched.deltas_match
    print(f"\nthroughput with readers / without = {ratio:.2f}; streamed == stored: {match}")

    args.out.mkdir(parents=True, exist_ok=True)
    stamp = f"{args.jobs}x{args.max_tokens}"
    chart = args.out / f"streams-{stamp}.png"
    title = (
        f"{args.jobs} jobs x {args.max_tokens} tokens on {machine['cpu_count']} CPUs — "
        f"throughput with/without readers = {ratio:.2f}"
    )
    save_chart(runs, title, chart)
    write_report(
        args.out / f"streams-{stamp}.json",
        chart,
        machine,
        model,
        {"jobs": args.jobs, "max_tokens": args.max_tokens, "ignore_eos": True},
        modes=[run.summary() for run in runs],
        throughput_ratio_with_readers=round(ratio, 4),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
