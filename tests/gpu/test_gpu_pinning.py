"""A GPU worker's device parts on a real NVIDIA GPU: pinning and the device-memory gauge.

Skipped on a host without an NVIDIA GPU (the only skip the suite allows). The engine itself is
not started here: these are the parts `inferq worker --gpus N` sets up before vLLM loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _physical_gpus() -> list[str]:
    """The UUIDs of the host's NVIDIA GPUs, by index, as NVML numbers them (empty: none)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVML library, or no driver: no GPU to test on
        return []
    count = pynvml.nvmlDeviceGetCount()
    return [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]


GPUS = _physical_gpus()
pytestmark = pytest.mark.skipif(not GPUS, reason="needs an NVIDIA GPU")

# Pins as the worker does, then imports torch and reports the GPUs it can use, by UUID.
_VISIBLE = """
import sys
from workers.devices import DeviceSpec, parse_gpus, pin_devices
spec = DeviceSpec("cpu") if sys.argv[1] == "cpu" else DeviceSpec("cuda", parse_gpus(sys.argv[1]))
pin_devices(spec)
import torch
for index in range(torch.cuda.device_count()):
    print(str(torch.cuda.get_device_properties(index).uuid))
"""


def _visible_uuids(device: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _VISIBLE, device],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def _same_gpu(nvml_uuid: str, torch_uuid: str) -> bool:
    # NVML writes "GPU-<uuid>", torch the bare uuid.
    return nvml_uuid.removeprefix("GPU-").lower() == torch_uuid.removeprefix("GPU-").lower()


def test_a_pinned_worker_sees_only_its_own_gpu() -> None:
    last = len(GPUS) - 1  # on a host of several GPUs, not merely the first one
    seen = _visible_uuids(str(last))
    assert len(seen) == 1
    assert _same_gpu(GPUS[last], seen[0])


def test_a_cpu_worker_sees_no_gpu() -> None:
    assert _visible_uuids("cpu") == []


def test_the_memory_gauge_follows_what_is_allocated_on_the_gpu() -> None:
    from core.metrics import DEVICE_MEMORY
    from workers.metrics import DeviceMemory

    index = len(GPUS) - 1
    memory = DeviceMemory("gpu-test@host", (index,))
    gauge = DEVICE_MEMORY.labels("gpu-test@host", f"gpu{index}")
    memory.sample()
    before = gauge._value.get()
    # Another process takes 2 GiB on that GPU, as the engine's weights and KV cache would.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, torch; x = torch.empty(2 << 30, dtype=torch.uint8, device='cuda'); "
            "torch.cuda.synchronize(); print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": str(index)},
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        memory.sample()
        during = gauge._value.get()
    finally:
        holder.kill()
        holder.wait()
    assert during - before >= 2 << 30
