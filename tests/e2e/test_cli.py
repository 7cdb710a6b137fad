"""The command line as a user drives it: `inferq up`, `inferq submit`, `inferq keys`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from core.db import Database
from core.jobs import JobStore
from core.models import as_utc
from inferq.local import free_port

INFERQ = [sys.executable, "-m", "inferq"]
LONG_JOB_TOKENS = 8000
"""About 11 s of generation on a fast host (4,000 tokens took 5.5 s in CI), 24 s on a slow one:
still generating when the test, which watches the worker's log, presses Ctrl-C (4,000 tokens
once ended first: the test saw the start 5.5 s late), and done inside the 60 s that `inferq up`
gives each process to stop."""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    env.update(INFERQ_DATA_DIR=str(tmp_path / ".inferq"), **extra)
    return env


def _descendants(pid: int) -> list[int]:
    """Every process under `pid`, read from /proc (`up`'s children run in groups of their own)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _get_when_up(url: str, **kwargs: Any) -> httpx.Response:
    deadline = time.monotonic() + 60
    while True:
        try:
            return httpx.get(url, timeout=5, **kwargs)
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_up_brings_the_system_up_and_submit_returns_text(tmp_path: Path, model_dir: Path) -> None:
    api_port, flower_port, worker_metrics = free_port(), free_port(), free_port()
    # Nothing listens on this Redis port, so `up` starts a Redis server of its own.
    env = _env(
        tmp_path,
        INFERQ_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0",
        INFERQ_MODEL=str(model_dir),
        INFERQ_WORKER_METRICS_PORT=str(worker_metrics),
        INFERQ_SCHEDULER_METRICS_PORT=str(free_port()),
        # Room for a job long enough to be surely running when Ctrl-C comes, on a fast host too.
        INFERQ_TIERS=json.dumps({"premium": {"max_tokens": LONG_JOB_TOKENS, "timeout_s": 120}}),
    )
    up = subprocess.Popen(
        [*INFERQ, "up", "--port", str(api_port), "--flower-port", str(flower_port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a foreground command
    )
    output: list[str] = []
    try:
        assert up.stdout is not None
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            output.append(line)
            if line.startswith("Try:"):
                break
        banner = "".join(output)
        assert "inferq is up." in banner, banner
        key = re.search(r"dev key (\S+)", banner)
        assert key is not None
        # Flower is behind the credentials `up` made; the worker's metrics are up.
        assert _get_when_up(f"http://127.0.0.1:{flower_port}/").status_code == 401
        credentials = (tmp_path / ".inferq" / "flower-auth").read_text().strip().split(":", 1)
        flower = _get_when_up(f"http://127.0.0.1:{flower_port}/", auth=tuple(credentials))
        assert flower.status_code == 200
        metrics = _get_when_up(f"http://127.0.0.1:{worker_metrics}/metrics").text
        assert "inferq_jobs_in_flight" in metrics

        submitted = subprocess.run(
            [
                *INFERQ,
                "submit",
                "Hello, inferq",
                "--max-tokens",
                "16",
                "--api-url",
                f"http://127.0.0.1:{api_port}",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert submitted.returncode == 0, submitted.stderr
        assert "succeeded" in submitted.stderr
        assert key.group(1) not in submitted.stdout + submitted.stderr

        flower = httpx.get(f"http://127.0.0.1:{flower_port}/", timeout=10)
        assert flower.status_code in (200, 401)

        # A long job is still generating when the user presses Ctrl-C.
        with httpx.Client(
            base_url=f"http://127.0.0.1:{api_port}",
            headers={"Authorization": f"Bearer {key.group(1)}"},
            timeout=30,
        ) as client:
            body = {"prompt": "Keep going", "max_tokens": LONG_JOB_TOKENS, "ignore_eos": True}
            long_job = client.post("/v1/jobs", json=body).json()
        # The worker's log says when the job is in the engine. (Polling the API for `running`
        # missed a 10 s run twice in CI: its answers came late while the job generated.)
        worker_log = tmp_path / ".inferq" / "logs" / "worker.log"
        deadline = time.monotonic() + 60
        while f"job {long_job['id']} started" not in worker_log.read_text(errors="replace"):
            assert time.monotonic() < deadline, "the long job never started"
            time.sleep(0.05)
    finally:
        interrupted_at = datetime.now(UTC)
        # As a terminal's Ctrl-C does: SIGINT to the whole foreground process group.
        os.killpg(up.pid, signal.SIGINT)
        try:
            code = up.wait(timeout=90)
        except subprocess.TimeoutExpired:
            for pid in [up.pid, *_descendants(up.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise
    assert code == 0
    # The worker's warm shutdown let the running job finish before the engine went down.
    stored = JobStore(Database(f"sqlite:///{tmp_path / '.inferq' / 'inferq.db'}")).get(
        long_job["id"]
    )
    assert stored is not None and stored.finished_at is not None
    assert (stored.status, stored.completion_tokens) == ("succeeded", LONG_JOB_TOKENS)
    assert as_utc(stored.finished_at) > interrupted_at  # it was still generating at Ctrl-C
    # Ctrl-C stopped the API too.
    try:
        httpx.get(f"http://127.0.0.1:{api_port}/healthz", timeout=2)
        still_up = True
    except httpx.HTTPError:
        still_up = False
    assert not still_up


def test_keys_create_list_revoke(tmp_path: Path) -> None:
    env = _env(tmp_path)
    run = lambda *args: subprocess.run(  # noqa: E731
        [*INFERQ, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert run("db", "upgrade").returncode == 0
    created = run("keys", "create", "--owner", "ada", "--tier", "premium")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("iq_") and len(key) > 40

    listed = run("keys", "list")
    assert "ada" in listed.stdout and "premium" in listed.stdout and "active" in listed.stdout
    assert key not in listed.stdout
    assert key.encode() not in (tmp_path / ".inferq" / "inferq.db").read_bytes()

    assert run("keys", "revoke", "1").returncode == 0
    assert "revoked" in run("keys", "list").stdout
    assert run("keys", "revoke", "1").returncode != 0
    bad_tier = run("keys", "create", "--owner", "ada", "--tier", "gold")
    assert bad_tier.returncode == 2 and "gold" in bad_tier.stderr


def test_worker_rejects_a_bad_gpu_list(tmp_path: Path) -> None:
    result = subprocess.run(
        [*INFERQ, "worker", "--gpus", "0,x"],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--gpus" in result.stderr
