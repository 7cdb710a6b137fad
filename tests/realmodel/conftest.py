"""The demo model as a new user meets it: `inferq up` on a fresh data directory, which fetches
and converts the model itself, then questions whose right answers a person can check.

Slower than the other groups (a model download and conversion, and an engine about 20 times
slower than the tiny model's), so it is one small group: `pytest tests/realmodel`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from inferq.local import free_port

pytestmark = pytest.mark.realmodel

INFERQ = [sys.executable, "-m", "inferq"]
UP_TIMEOUT_S = 900
"""Download, conversion (about a minute) and the engine's first compile (a few minutes here)."""


@dataclass
class DemoStack:
    """`inferq up` running the demo model, and what its banner said."""

    api_url: str
    key: str
    flower_url: str
    flower_auth: tuple[str, str]
    workdir: Path
    env: dict[str, str]
    banner: str

    @property
    def model_dir(self) -> Path:
        """Where `up` made the model."""
        return self.workdir / ".inferq" / "model"

    def inferq(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        """Run an `inferq` command as the user would, beside the running stack."""
        return subprocess.run(
            [*INFERQ, *args],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )


def template_token_count(model_dir: Path, messages: list[dict[str, str]]) -> int:
    """The prompt's length in tokens once the model's own chat template renders `messages`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if isinstance(ids, Mapping) else ids)


@pytest.fixture(scope="session")
def demo_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoStack]:
    """`inferq up` in an empty directory with no model configured, as on a fresh clone."""
    workdir = tmp_path_factory.mktemp("fresh")
    api_port, flower_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    env.update(
        INFERQ_DATA_DIR=str(workdir / ".inferq"),
        # Nothing answers there, so `up` starts a Redis of its own.
        INFERQ_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0",
        INFERQ_WORKER_METRICS_PORT=str(free_port()),
        INFERQ_SCHEDULER_METRICS_PORT=str(free_port()),
    )
    up = subprocess.Popen(
        [*INFERQ, "up", "--port", str(api_port), "--flower-port", str(flower_port)],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        assert up.stdout is not None
        deadline = time.monotonic() + UP_TIMEOUT_S
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("Try:"):
                break
        banner = "".join(lines)
        key = re.search(r"dev key (\S+)", banner)
        assert key is not None, banner
        user, password = (workdir / ".inferq" / "flower-auth").read_text().strip().split(":", 1)
        yield DemoStack(
            api_url=f"http://127.0.0.1:{api_port}",
            key=key.group(1),
            flower_url=f"http://127.0.0.1:{flower_port}",
            flower_auth=(user, password),
            workdir=workdir,
            env=env,
            banner=banner,
        )
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(timeout=90)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(up.pid, signal.SIGKILL)
        for name in ("worker", "api"):
            log = workdir / ".inferq" / "logs" / f"{name}.log"
            if log.exists():
                tail = log.read_text(errors="replace").splitlines()[-10:]
                sys.stderr.write(f"\n--- {name}.log (tail) ---\n" + "\n".join(tail) + "\n")
