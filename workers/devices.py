"""Device pinning: decide which devices a worker owns before vLLM (and torch) are imported."""

from __future__ import annotations

import itertools
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class DeviceSpec:
    """The devices one worker owns: `cpu`, or a list of GPU indices."""

    kind: str  # "cpu" or "cuda"
    gpus: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        """`cpu`, `gpu0`, or `gpu0-1` for a tensor-parallel group."""
        if self.kind == "cpu":
            return "cpu"
        return "gpu" + "-".join(str(g) for g in self.gpus)

    def node_name(self, host: str | None = None) -> str:
        """The Celery node name, e.g. `gpu0@host`, as Flower shows it."""
        return f"{self.label}@{host or socket.gethostname()}"

    def node_names(self, host: str | None = None) -> Iterator[str]:
        """The names a worker on these devices may take, first choice first: `cpu@host`, then
        `cpu.2@host`, `cpu.3@host`, … for more workers of the same devices on one host."""
        host = host or socket.gethostname()
        yield self.node_name(host)
        for number in itertools.count(2):
            yield f"{self.label}.{number}@{host}"


OMP_BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"
"""Where vLLM's CPU build binds each engine's forward-pass threads (default `auto`)."""


def unbind_extra_cpu_engine(spec: DeviceSpec, node_name: str, host: str | None = None) -> bool:
    """Let the engine of a host's second, third, … CPU worker (`cpu.2@host`, …) run on any core.

    vLLM binds every CPU engine's forward pass to the same cores (all but the last one), whatever
    else runs on the host: two workers on a 2-core host both computed on core 0, and while one
    generated, the other and the API beside them stalled for seconds (a cancel then reached its
    job after it had ended). A binding set in the environment is kept; so is the first worker's.
    Must run before the engine starts. Returns whether it changed anything.
    """
    host = host or socket.gethostname()
    numbered = node_name.startswith(f"{spec.label}.") and node_name.endswith(f"@{host}")
    if spec.kind != "cpu" or not numbered or OMP_BIND_VARIABLE in os.environ:
        return False
    os.environ[OMP_BIND_VARIABLE] = "nobind"
    return True


def engine_build() -> str:
    """Which vLLM build is installed: `cpu` for vllm-cpu, else `cuda`."""
    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return "cuda"
    return "cpu"


def parse_gpus(value: str) -> tuple[int, ...]:
    """`"0,1"` → (0, 1); raises ValueError on anything else."""
    gpus = tuple(int(part) for part in value.split(",") if part.strip())
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus wants distinct device indices like 0 or 0,1; got {value!r}")
    return gpus


def pin_devices(spec: DeviceSpec) -> None:
    """Make only this worker's devices visible; must run before vLLM is imported."""
    if "vllm" in sys.modules or "torch" in sys.modules:
        raise RuntimeError("devices must be pinned before vllm or torch is imported")
    if spec.kind == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


ENGINE_CORE_PROCESS = "VLLM::EngineCor"
"""How vLLM's engine-core process names itself (a process name keeps 15 characters)."""


def lower_engine_core_priority(nice: int, parent: int | None = None) -> list[int]:
    """Give every thread of the engine-core processes under `parent` this nice value.

    On the CPU build, the engine core's scheduler loop shares the cores left over from the
    forward pass with the worker's own threads, the API, Redis and the database, and it spins
    while it waits for each forward pass. A higher nice value lets the others run first when
    they have work, and the engine core takes the rest. Returns the process ids changed.
    """
    parent = os.getpid() if parent is None else parent
    changed = []
    for pid in _children(parent):
        try:
            with open(f"/proc/{pid}/comm") as comm:
                if comm.read().strip() != ENGINE_CORE_PROCESS:
                    continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except OSError:  # gone meanwhile, or not ours to change
            continue
        changed.append(pid)
    return changed


def _children(parent: int) -> list[int]:
    """Process ids of `parent`'s direct children, from /proc (Linux)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # The command name in parentheses may hold spaces: the fields follow its ')'.
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent:
            children.append(int(entry))
    return children


NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}
"""CPU flags of native bf16 arithmetic; without them torch emulates it, several times slower."""


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes in bf16 natively (from /proc/cpuinfo's flags)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as file:
                cpuinfo = file.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return bool(NATIVE_BF16_FLAGS & set(line.partition(":")[2].split()))
    return False
