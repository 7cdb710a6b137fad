"""Token streams: generation throughput with and without live SSE readers, stream latency, and
the same jobs streamed by vLLM's own server.

Runs the same jobs on one local stack, side by side in one run: once watched by nobody
(clients long-poll for the result), once with one live `GET /v1/jobs/{id}/events` reader per
job; then (unless `--no-vllm`) as `/v1/completions` requests to vLLM's own server on the
worker's engine arguments, all at once, streamed and not. Each mode records the CPU seconds of
each process role (the benchmark process is the clients): what readers cost, and where.
Stream latency is the time from the engine step that made a token (the delta's `at`) to the
moment the SSE client has parsed the event carrying it; events made before their reader
connected are replay, not latency, and are left out. vLLM's server says nothing of when it
made a token, so the measure both share is the client's: the gap between consecutive
text-bearing events of one stream (the stutter a reader sees, vLLM's own "inter-token latency"
for chunked streams), and the time from submission to the first text.

Run: `.venv/bin/python bench/streams.py [--jobs 64 --max-tokens 256 --out bench/results]`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
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
    cpu_use,
    descendants,
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
    gaps_s: list[float] = field(default_factory=list)
    """Between consecutive text-bearing events of one stream, at the client."""
    first_text_s: list[float] = field(default_factory=list)
    """From submission to the first text at the client, per stream."""
    events: int = 0
    deltas_match: bool = True
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds by process role during the mode (see `report.process_role`)."""

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
            "chunk_gap_p50_ms": round(percentile(self.gaps_s, 50) * 1000, 2),
            "chunk_gap_p99_ms": round(percentile(self.gaps_s, 99) * 1000, 2),
            "first_text_p50_s": round(percentile(self.first_text_s, 50), 4),
            "streamed_text_equals_stored": self.deltas_match,
            "cpu_s": self.cpu_s,
        }


def _note_arrivals(run: StreamRun, submitted_at: float, arrivals: list[float]) -> None:
    """Fold one stream's text arrival times into the run's client-side figures."""
    if arrivals:
        run.first_text_s.append(arrivals[0] - submitted_at)
        run.gaps_s.extend(b - a for a, b in itertools.pairwise(arrivals))


async def _read_stream(
    session: aiohttp.ClientSession, job_id: str, run: StreamRun, submitted_at: float
) -> tuple[str, int]:
    """Follow one job's SSE stream to its final event; returns its text and token count."""
    connected_at = time.time()
    arrivals: list[float] = []
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
                    now = time.time()
                    if event["at"] >= connected_at:
                        run.latency_s.append(now - event["at"])
                    if event["text"]:
                        arrivals.append(now)
                    text.append(event["text"])
                    tokens += event["tokens"]
                elif event["type"] in FINAL_EVENTS:
                    break
    _note_arrivals(run, submitted_at, arrivals)
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
        submitted_at = time.time()
        submitted = await _submit_batch(session, body)
        streams = (
            asyncio.gather(
                *(_read_stream(session, job["id"], run, submitted_at) for job in submitted)
            )
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


async def run_vllm(
    url: str, model: str, jobs: int, max_tokens: int, *, stream: bool = True
) -> StreamRun:
    """The same jobs as completions on vLLM's own server, all sent at once."""
    run = StreamRun("vLLM server, " + ("streamed" if stream else "not streamed"), jobs)
    connector = aiohttp.TCPConnector(limit=jobs + 8)
    timeout = aiohttp.ClientTimeout(total=600)
    ends: list[float] = []

    async def one(session: aiohttp.ClientSession, index: int) -> None:
        body = {
            "model": model,
            "prompt": f"Stream {index}.",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
        } | ({"stream_options": {"include_usage": True}} if stream else {})
        arrivals: list[float] = []
        async with session.post("/v1/completions", json=body) as response:
            response.raise_for_status()
            if not stream:
                run.tokens += (await response.json())["usage"]["completion_tokens"]
                run.succeeded += 1
                ends.append(time.time())
                return
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                run.events += 1
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    arrivals.append(time.time())
                if chunk.get("usage"):
                    run.tokens += chunk["usage"]["completion_tokens"]
                    run.succeeded += 1
        ends.append(time.time())
        _note_arrivals(run, started, arrivals)

    async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout) as session:
        started = time.time()
        await asyncio.gather(*(one(session, i) for i in range(jobs)))
    run.server_span_s = max(ends) - started
    return run


def save_chart(runs: list[StreamRun], title: str, path: Path) -> None:
    """Throughput bars for both modes, and the CDF of stream latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = ["#4c72b0", "#dd8452", "#8c8c8c", "#55a868"][: len(runs)]
    bars = left.bar([r.mode for r in runs], [r.tokens_per_s for r in runs], color=colors)
    left.bar_label(bars, fmt="%.0f")
    left.tick_params(axis="x", labelrotation=15)
    left.set_ylabel("completion tokens / s")
    left.set_title("Generation throughput")
    for run in runs:
        if run.gaps_s:
            ordered = sorted(s * 1000 for s in run.gaps_s)
            fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
            right.plot(ordered, fractions, label=run.mode)
    right.set_xscale("log")
    right.set_xlabel("gap between a stream's text events at the client, ms")
    right.set_ylabel("fraction of gaps")
    right.set_title("Stream stutter (CDF)")
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
    parser.add_argument("--no-vllm", action="store_true", help="skip the run on vLLM's own server")
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
    runs: list[StreamRun] = []
    before = descendants()
    with running_stack(settings, free_port()) as (api_url, key, _):
        measured = descendants() - before | {os.getpid()}
        warm = asyncio.run(run_mode(api_url, key, 4, 8, readers=True))
        assert warm.succeeded == 4, "warm-up failed"
        for readers in (False, True):
            with cpu_use(measured) as used:
                run = asyncio.run(
                    run_mode(api_url, key, args.jobs, args.max_tokens, readers=readers)
                )
            runs.append(run)
            run.cpu_s = used
    if not args.no_vllm:
        from vllm_server import vllm_server

        with vllm_server(settings, free_port(), work_dir / "vllm-server.log") as (url, _pid):
            measured = descendants() - before | {os.getpid()}
            asyncio.run(run_vllm(url, settings.model_name, 4, 8))  # warm-up
            for stream in (False, True):
                with cpu_use(measured) as used:
                    run = asyncio.run(
                        run_vllm(
                            url, settings.model_name, args.jobs, args.max_tokens, stream=stream
                        )
                    )
                runs.append(run)
                run.cpu_s = used
    shutil.rmtree(work_dir, ignore_errors=True)

    quiet, watched = runs[:2]
    ratio = watched.tokens_per_s / quiet.tokens_per_s if quiet.tokens_per_s else float("nan")
    print(
        f"{'mode':<22}{'jobs':>5}{'tokens/s':>10}{'events':>8}{'first text p50 s':>17}"
        f"{'gap p50 ms':>11}{'gap p99 ms':>11}{'step→client p50/p99 ms':>24}"
    )
    for run in runs:
        summary = run.summary()
        latency = (
            f"{summary['stream_latency_p50_ms']:.1f} / {summary['stream_latency_p99_ms']:.1f}"
            if run.latency_s
            else "—"
        )
        print(
            f"{run.mode:<22}{run.succeeded:>5}{run.tokens_per_s:>10.1f}{run.events:>8}"
            f"{summary['first_text_p50_s']:>17.3f}{summary['chunk_gap_p50_ms']:>11.1f}"
            f"{summary['chunk_gap_p99_ms']:>11.1f}{latency:>24}"
        )
    print("\nCPU seconds by process role (the benchmark process is the clients)")
    for run in runs:
        print(f"{run.mode:<22}" + ", ".join(f"{k} {v:.2f}" for k, v in sorted(run.cpu_s.items())))
    match = watched.deltas_match
    print(f"\nthroughput with readers / without = {ratio:.2f}; streamed == stored: {match}")
    extra = {}
    if len(runs) == 4:
        vllm_quiet, vllm_streamed = runs[2:]
        vllm_ratio = vllm_streamed.tokens_per_s / vllm_quiet.tokens_per_s
        gap_ratio = percentile(watched.gaps_s, 99) / percentile(vllm_streamed.gaps_s, 99)
        print(f"vLLM's server, streamed / not streamed = {vllm_ratio:.2f}")
        print(f"gap p99, inferq / vLLM's server = {gap_ratio:.2f}")
        extra["vllm_throughput_ratio_streamed"] = round(vllm_ratio, 4)
        extra["chunk_gap_p99_inferq_over_vllm"] = round(gap_ratio, 4)

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
        **extra,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
