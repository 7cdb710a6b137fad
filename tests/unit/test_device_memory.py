"""The CPU worker's memory gauge: its own resident memory plus its children's (the engine's)."""

from __future__ import annotations

import subprocess
import sys

import psutil

from core.metrics import DEVICE_MEMORY
from workers.metrics import DeviceMemory


def _gauge(worker: str) -> float:
    return float(DEVICE_MEMORY.labels(worker, "cpu")._value.get())


def test_children_are_counted_and_looked_up_again_once_one_has_gone() -> None:
    memory = DeviceMemory("unit-memory", ())
    own = psutil.Process().memory_info().rss
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        memory.sample()
        assert child.pid in {c.pid for c in memory._children}
        assert _gauge("unit-memory") > own
        looked_up = memory._children
        memory.sample()
        assert memory._children is looked_up  # not walked again on every sample
    finally:
        child.kill()
        child.wait()
    memory.sample()  # the child is gone: the next sample looks the children up again
    memory.sample()
    assert child.pid not in {c.pid for c in memory._children}
