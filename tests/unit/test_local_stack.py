"""`inferq up`'s children: stopping the stack leaves nothing of theirs running.

A worker that dies (a crash, the OOM killer) leaves its engine core running in its process
group, holding the engine's memory. Here a shell stands for the worker and a `sleep` it leaves
behind for its engine core.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import time
from pathlib import Path

from core.settings import Settings
from inferq.local import LocalStack


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent has not read its status yet


def _wait_for_file(path: Path) -> str:
    deadline = time.monotonic() + 10
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.05)
    return path.read_text().strip()


def test_stopping_kills_what_a_dead_child_left_in_its_group(tmp_path: Path) -> None:
    stack = LocalStack(Settings(data_dir=tmp_path))
    left = tmp_path / "left.pid"
    child = stack.start(
        "worker", ["sh", "-c", f"sleep 300 & echo $! > {shlex.quote(str(left))}; exit 3"]
    )
    orphan = int(_wait_for_file(left))
    try:
        child.wait(timeout=10)
        assert _running(orphan)
        stack.stop()
        deadline = time.monotonic() + 10
        while _running(orphan):
            assert time.monotonic() < deadline, "the dead child's process lives on"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)
