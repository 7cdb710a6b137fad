"""Edge batching: many small jobs, taken one message a round trip or in bulk.

In one run, the same workload on two fresh stacks that differ only in `INFERQ_EDGE_BATCH`
(1: one message a take, as Celery takes them; 32: the default): `--jobs` small jobs
(`--max-tokens` tokens each) submitted in batches of 100 while the worker is busy, so they
wait. Reported per stack: jobs/s (first submitted → last finished), queue wait p50/p95, and
Redis commands per job (all of them, from the stack's own redis-server: API, worker and
scheduler), with the workers' waits (BLPOP) and takes counted apart, and split into the
commands the processes send and those their Lua scripts run inside Redis (read from MONITOR:
one round trip can run many commands in a script, so the two measure different costs).

Run: `.venv/bin/python bench/edge_batching.py [--jobs 1000 --max-tokens 1]`.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import threading
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
from scheduling import _batch, _span_s, _wait

REPO_ROOT = Path(__file__).resolve().parents[1]
SETTINGS = (("one per take", "1"), ("edge batch 32", "32"))


def _command_calls(client: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


class ScriptCommands:
    """Counts the commands Lua scripts run in a Redis, from its MONITOR feed, in a thread."""

    STOP = "inferq-bench-monitor-stop"

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.count = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> ScriptCommands:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self.client.echo(self.STOP)  # wakes the feed's read
        self._thread.join(timeout=10)

    def _watch(self) -> None:
        with self.client.monitor() as feed:
            for command in feed.listen():
                if command["client_type"] == "lua":
                    self.count += 1
                elif self._stopping.is_set() and self.STOP in command["command"]:
                    return


async def run(api_url: str, key: str, jobs: int, max_tokens: int) -> list[dict[str, Any]]:
    """Submit `jobs` jobs in batches of 100 (the last one smaller), all at once, and wait for
    every one."""
    async with aiohttp.ClientSession(base_url=api_url) as session:
        batches = [
            [
                {"prompt": f"Small job {j}.", "max_tokens": max_tokens}
                for j in range(i, min(i + 100, jobs))
            ]
            for i in range(0, jobs, 100)
        ]
        created = await asyncio.gather(*(_batch(session, key, batch) for batch in batches))
        flat = [job for batch in created for job in batch]
        return list(await asyncio.gather(*(_wait(session, key, job["id"]) for job in flat)))


def save_chart(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Bars: jobs/s and Redis commands per job, for each setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = list(results)
    colors = ["tab:gray", "tab:green"]
    left.bar(labels, [r["jobs_per_s"] for r in results.values()], color=colors)
    left.set_ylabel("jobs per second")
    left.set_title("small jobs through the queue")
    right.bar(labels, [r["redis_commands_per_job"] for r in results.values()], color=colors)
    right.set_ylabel("Redis commands per job (all processes)")
    right.set_title("Redis round trips")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """Run both settings, print the table, save chart and JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_argument(parser)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)

    from inferq.local import free_port

    machine = machine_info()
    work_root = Path(tempfile.mkdtemp(prefix="inferq-bench-"))
    model_dir = bench_model(args.model)
    model = model_facts(model_dir)
    print(
        f"machine : {machine['cpu_count']} CPUs, {machine['cpu_model']}; {machine['vllm']}\n"
        f"{model_line(model)}\n"
        f"workload: {args.jobs} jobs x {args.max_tokens} tokens, posted in batches of 100\n",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    for label, edge_batch in SETTINGS:
        settings = bench_settings(work_root / f"edge-{edge_batch}", model_dir)
        env = {"INFERQ_EDGE_BATCH": edge_batch, "INFERQ_RESULT_CACHE_TTL_S": "0"}
        # The stack's own redis-server, so its command counts can be read.
        with (
            own_redis(settings) as client,
            running_stack(settings, free_port(), env) as (api_url, key, _),
        ):
            before = _command_calls(client)
            with ScriptCommands(client) as in_scripts:
                done = asyncio.run(run(api_url, key, args.jobs, args.max_tokens))
            after = _command_calls(client)
        calls = {name: after[name] - before.get(name, 0) for name in after}
        calls["monitor"] = calls.get("monitor", 0) - 1  # the bench's own
        calls["echo"] = calls.get("echo", 0) - 1
        total = sum(calls.values())
        waits = [job["timings"]["queue_s"] for job in done if job["timings"]["queue_s"]]
        results[label] = {
            "jobs_per_s": round(len(done) / _span_s(done), 1),
            "succeeded": sum(job["status"] == "succeeded" for job in done),
            "queue_wait_p50_s": round(percentile(waits, 50), 3),
            "queue_wait_p95_s": round(percentile(waits, 95), 3),
            "redis_commands_per_job": round(total / len(done), 1),
            "sent_per_job": round((total - in_scripts.count) / len(done), 1),
            "run_in_scripts_per_job": round(in_scripts.count / len(done), 1),
            "waits_per_job": round(calls.get("blpop", 0) / len(done), 2),
            "lua_script_calls_per_job": round(
                (calls.get("evalsha", 0) + calls.get("eval", 0)) / len(done), 2
            ),
            # Where they go: each command's calls per job, the most frequent first.
            "commands_per_job_by_name": {
                name: round(count / len(done), 2)
                for name, count in sorted(calls.items(), key=lambda item: -item[1])
                if count
            },
        }
        print(f"{label}: {results[label]}", flush=True)
    shutil.rmtree(work_root, ignore_errors=True)

    header = f"{'setting':<16}{'jobs/s':>8}{'wait p50':>10}{'wait p95':>10}{'cmds/job':>10}"
    print(f"\n{header}{'sent':>7}{'in Lua':>8}{'waits/job':>11}")
    for label, r in results.items():
        print(
            f"{label:<16}{r['jobs_per_s']:>8}{r['queue_wait_p50_s']:>10}"
            f"{r['queue_wait_p95_s']:>10}{r['redis_commands_per_job']:>10}{r['sent_per_job']:>7}"
            f"{r['run_in_scripts_per_job']:>8}{r['waits_per_job']:>11}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    chart = args.out / "edge_batching.png"
    save_chart(results, chart)
    workload = vars(args) | {"out": str(args.out)}
    write_report(args.out / "edge_batching.json", chart, machine, model, workload, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
