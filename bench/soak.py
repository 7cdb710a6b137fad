"""Soak: thousands of small jobs through a local stack; does Redis go back to where it started?

One run: a fresh local stack (own redis-server, SQLite, one CPU worker, the scheduler, the
API) with short per-job key TTLs (`--key-ttl`, default 30 s, set as `INFERQ_JOB_KEY_TTL_S`,
and `INFERQ_RESULT_CACHE_TTL_S` the same), so the keys lapse in seconds rather than a day.
It records Redis' key count (DBSIZE) and `used_memory` at baseline (stack up, no jobs yet),
submits `--jobs` small jobs (4 to 8 tokens each) in `POST /v1/jobs/batch` requests of 100
(retrying a batch refused with 429 after its Retry-After), samples Redis every half second,
waits until every job is final (read from the database), waits until every per-job key
(`inferq:job:*`) has expired, records again, then runs `inferq db purge --older-than 0` and
counts the job rows before and after. Final states are counted from the database: every
accepted job must be there and final (0 lost).

Run: `.venv/bin/python bench/soak.py [--jobs 5000 --key-ttl 30]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
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
    running_stack,
    write_report,
)
from sqlalchemy import create_engine, text

REPO_ROOT = Path(__file__).resolve().parents[1]
BATCH_SIZE = 100
CONCURRENT_BATCHES = 2
FINAL = ("succeeded", "failed", "cancelled", "timed_out")
JOB_KEY_PATTERN = "inferq:job:*"
MAX_RETRY_WAIT_S = 5.0


class RedisSampler:
    """Samples DBSIZE and used_memory every `interval_s` in a thread, from `start()` on."""

    def __init__(self, client: redis.Redis, interval_s: float = 0.5) -> None:
        self.client = client
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int]] = []  # (monotonic s, keys, used_memory)
        self.t0 = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[int, int]:
        """Key count and used_memory now."""
        keys = int(self.client.dbsize())
        memory = int(self.client.info("memory")["used_memory"])
        return keys, memory

    def _run(self) -> None:
        while not self._stopped.is_set():
            keys, memory = self.sample()
            self.samples.append((time.monotonic() - self.t0, keys, memory))
            self._stopped.wait(self.interval_s)

    def start(self) -> None:
        """Start sampling."""
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling."""
        self._stopped.set()
        self._thread.join()


def count_keys(client: redis.Redis, pattern: str) -> int:
    """Keys matching `pattern` (SCAN, so the server never blocks)."""
    return sum(1 for _ in client.scan_iter(match=pattern, count=1000))


def key_families(client: redis.Redis) -> dict[str, int]:
    """Keys grouped by name with ids and digests cut off (e.g. `inferq:job:*:stream`)."""
    families: Counter[str] = Counter()
    for raw in client.scan_iter(count=1000):
        name = raw.decode()
        parts = name.split(":")
        if name.startswith("inferq:job:") and len(parts) >= 4:
            name = f"inferq:job:*:{parts[3]}"
        elif name.startswith(("inferq:finished:", "inferq:cache:")):
            name = ":".join(parts[:2]) + ":*"
        families[name] += 1
    return dict(sorted(families.items()))


def job_statuses(database_url: str, owner: str) -> Counter[str]:
    """How many of the owner's jobs are in each state, from the database."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                text("SELECT status, COUNT(*) FROM jobs WHERE owner = :owner GROUP BY status"),
                {"owner": owner},
            )
            return Counter({status: int(n) for status, n in rows})
    finally:
        engine.dispose()


def stored_job_ids(database_url: str) -> set[str]:
    """Every job id in the database."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            return {row[0] for row in connection.execute(text("SELECT id FROM jobs"))}
    finally:
        engine.dispose()


async def submit_all(api_url: str, key: str, jobs: int, seed: int) -> tuple[list[str], int, float]:
    """Submit `jobs` small jobs in batches; returns the accepted ids, 429s met, and seconds."""
    rng = random.Random(seed)
    bodies = [
        {"prompt": f"Soak job {i}: say something short.", "max_tokens": rng.randint(4, 8)}
        for i in range(jobs)
    ]
    batches = [bodies[i : i + BATCH_SIZE] for i in range(0, jobs, BATCH_SIZE)]
    accepted: list[str] = []
    refused = 0
    pending = asyncio.Queue[list[dict[str, Any]]]()
    for batch in batches:
        pending.put_nowait(batch)
    headers = {"Authorization": f"Bearer {key}"}

    async def sender(session: aiohttp.ClientSession) -> None:
        nonlocal refused
        while not pending.empty():
            batch = pending.get_nowait()
            while True:
                async with session.post("/v1/jobs/batch", json={"jobs": batch}) as response:
                    if response.status == 202:
                        accepted.extend(job["id"] for job in (await response.json())["data"])
                        break
                    if response.status != 429:
                        raise RuntimeError(
                            f"POST /v1/jobs/batch: {response.status} {await response.text()}"
                        )
                    refused += 1
                    retry_after = float(response.headers.get("Retry-After", "1"))
                    error = (await response.json())["error"]
                    print(
                        f"429 {error['code']} (Retry-After {retry_after:g} s): {error['message']}",
                        flush=True,
                    )
                    # At most a few seconds: the backlog drains while we wait.
                    await asyncio.sleep(min(retry_after, MAX_RETRY_WAIT_S))

    started = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(base_url=api_url, headers=headers, timeout=timeout) as s:
        await asyncio.gather(*(sender(s) for _ in range(CONCURRENT_BATCHES)))
    return accepted, refused, time.perf_counter() - started


def wait_all_final(database_url: str, owner: str, total: int, timeout_s: float) -> Counter[str]:
    """Poll the database until `total` of the owner's jobs are final."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = job_statuses(database_url, owner)
        if sum(statuses[s] for s in FINAL) >= total or time.monotonic() > deadline:
            return statuses
        time.sleep(1.0)


def wait_job_keys_gone(client: redis.Redis, timeout_s: float) -> tuple[int, float]:
    """Wait until no per-job key is left; returns how many are left and the seconds waited."""
    started = time.monotonic()
    while True:
        left = count_keys(client, JOB_KEY_PATTERN)
        if left == 0 or time.monotonic() - started > timeout_s:
            return left, time.monotonic() - started
        time.sleep(1.0)


def save_chart(samples: list[tuple[float, int, int]], marks: dict[str, float], path: Path) -> None:
    """Key count and used_memory over time, with the phases marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [t for t, _, _ in samples]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    top.plot(times, [k for _, k, _ in samples], color="tab:blue")
    top.set_ylabel("Redis keys (DBSIZE)")
    bottom.plot(times, [m / 2**20 for _, _, m in samples], color="tab:orange")
    bottom.set_ylabel("used_memory, MiB")
    bottom.set_xlabel("seconds since baseline")
    for axis in (top, bottom):
        for label, at in marks.items():
            axis.axvline(at, color="gray", linestyle="--", linewidth=0.8)
            if axis is top:
                axis.annotate(
                    label,
                    (at, 1),
                    xycoords=("data", "axes fraction"),
                    rotation=90,
                    va="top",
                    ha="right",
                    fontsize=8,
                )
    figure.suptitle("Soak: Redis keys and memory through submission, completion, TTLs, purge")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    """Run the soak, print the table, save chart and JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_argument(parser)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--key-ttl", type=int, default=30, help="INFERQ_JOB_KEY_TTL_S, seconds")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)

    from inferq.local import free_port

    machine = machine_info()
    work_dir = Path(tempfile.mkdtemp(prefix="inferq-soak-"))
    model_dir = bench_model(args.model)
    model = model_facts(model_dir)
    settings = bench_settings(work_dir, model_dir)
    database_url = settings.sqlalchemy_url
    env = {
        "INFERQ_JOB_KEY_TTL_S": str(args.key_ttl),
        "INFERQ_RESULT_CACHE_TTL_S": str(args.key_ttl),
        # A long enough deadline that the backlog of a fast submitter never times out here.
        "INFERQ_TIERS": json.dumps({"premium": {"timeout_s": 600}}),
    }
    print(
        f"machine : {machine['cpu_count']} CPUs, {machine['cpu_model']}; {machine['vllm']}\n"
        f"{model_line(model)}\n"
        f"workload: {args.jobs} jobs x 4-8 tokens, batches of {BATCH_SIZE}, "
        f"{CONCURRENT_BATCHES} at a time; per-job key TTL {args.key_ttl} s\n",
        flush=True,
    )
    phases: dict[str, dict[str, Any]] = {}
    marks: dict[str, float] = {}
    ok = False
    try:
        # The stack's own redis-server, so its figures can be read.
        with (
            own_redis(settings) as client,
            running_stack(settings, free_port(), env) as (api_url, key, _),
        ):
            sampler = RedisSampler(client)
            time.sleep(2.0)  # let the first heartbeats and bindings settle
            keys, memory = sampler.sample()
            phases["baseline"] = {
                "keys": keys,
                "used_memory": memory,
                "families": key_families(client),
            }
            sampler.start()
            marks["submit"] = time.monotonic() - sampler.t0
            accepted, refused, submit_s = asyncio.run(
                submit_all(api_url, key, args.jobs, args.seed)
            )
            print(
                f"submitted {len(accepted)} jobs in {submit_s:.1f} s ({refused} batches got 429)",
                flush=True,
            )
            statuses = wait_all_final(database_url, "bench", len(accepted), timeout_s=1800)
            all_final_at = time.monotonic()
            marks["all final"] = all_final_at - sampler.t0
            keys, memory = sampler.sample()
            phases["all final"] = {
                "keys": keys,
                "used_memory": memory,
                "families": key_families(client),
            }
            print(
                f"all final after {all_final_at - sampler.t0 - marks['submit']:.1f} s: "
                f"{dict(statuses)}",
                flush=True,
            )
            left, waited = wait_job_keys_gone(client, timeout_s=2 * args.key_ttl + 60)
            marks["job keys gone"] = time.monotonic() - sampler.t0
            keys, memory = sampler.sample()
            phases["after TTLs"] = {
                "keys": keys,
                "used_memory": memory,
                "families": key_families(client),
                "job_keys_left": left,
                "waited_s": round(waited, 1),
            }
            rows_before = len(stored_job_ids(database_url))
            started = time.perf_counter()
            purge = subprocess.run(
                [sys.executable, "-m", "inferq", "db", "purge", "--older-than", "0"],
                env={
                    **os.environ,
                    "INFERQ_DATABASE_URL": database_url,
                    "INFERQ_DATA_DIR": str(work_dir),
                    "INFERQ_LOG_LEVEL": "WARNING",
                },
                capture_output=True,
                text=True,
                check=True,
            )
            purge_s = time.perf_counter() - started
            rows_after = len(stored_job_ids(database_url))
            marks["purge"] = time.monotonic() - sampler.t0
            time.sleep(1.0)
            sampler.stop()
            keys, memory = sampler.sample()
            phases["after purge"] = {"keys": keys, "used_memory": memory}
        ok = True
    finally:
        if ok:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            print(f"kept {work_dir} (logs under logs/)", file=sys.stderr)

    peak_at, peak_keys, _ = max(sampler.samples, key=lambda s: s[1])
    peak_memory = max(m for _, _, m in sampler.samples)
    phases = {
        "baseline": phases["baseline"],
        "peak": {"keys": peak_keys, "used_memory": peak_memory, "at_s": round(peak_at, 1)},
        **{name: value for name, value in phases.items() if name != "baseline"},
    }
    final = sum(statuses[s] for s in FINAL)
    lost = len(accepted) - final
    print(f"\n{'phase':<12}{'keys':>8}{'used_memory MiB':>17}")
    for name, phase in phases.items():
        print(f"{name:<12}{phase['keys']:>8}{phase['used_memory'] / 2**20:>17.2f}")
    print(
        f"\njobs: {len(accepted)} accepted, final {dict(statuses)}, lost {lost}; "
        f"{refused} batch requests refused with 429 and retried\n"
        f"per-job keys left after waiting {phases['after TTLs']['waited_s']} s: "
        f"{phases['after TTLs']['job_keys_left']}\n"
        f"keys after TTLs, by family: {phases['after TTLs']['families']}\n"
        f"purge: {purge.stdout.strip()} in {purge_s:.2f} s; job rows {rows_before} → {rows_after}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    chart = args.out / "soak.png"
    save_chart(sampler.samples, marks, chart)
    workload = {
        "jobs": args.jobs,
        "max_tokens": "4-8",
        "batch_size": BATCH_SIZE,
        "concurrent_batches": CONCURRENT_BATCHES,
        "job_key_ttl_s": args.key_ttl,
    }
    write_report(
        args.out / "soak.json",
        chart,
        machine,
        model,
        workload,
        phases=phases,
        jobs={
            "accepted": len(accepted),
            "statuses": dict(statuses),
            "lost": lost,
            "batches_refused_429": refused,
            "submit_s": round(submit_s, 2),
            "completion_s": round(marks["all final"] - marks["submit"], 2),
        },
        purge={
            "output": purge.stdout.strip(),
            "seconds": round(purge_s, 3),
            "job_rows_before": rows_before,
            "job_rows_after": rows_after,
        },
        samples=[[round(t, 2), k, m] for t, k, m in sampler.samples],
    )
    return 0 if lost == 0 and rows_after == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
