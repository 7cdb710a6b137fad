"""Device pinning and worker names."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from workers.devices import (
    ENGINE_CORE_PROCESS,
    OMP_BIND_VARIABLE,
    DeviceSpec,
    lower_engine_core_priority,
    parse_gpus,
    unbind_extra_cpu_engine,
)

# A child that names itself (as vLLM's processes do), starts a second thread, and waits.
_CHILD = """
import sys, threading, time
with open("/proc/self/comm", "w") as comm:
    comm.write(sys.argv[1])
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_node_names_follow_the_devices() -> None:
    assert DeviceSpec("cuda", (0,)).node_name("host") == "gpu0@host"
    assert DeviceSpec("cuda", (2, 3)).node_name("host") == "gpu2-3@host"
    assert DeviceSpec("cpu").node_name("host") == "cpu@host"


def test_more_workers_of_the_same_devices_on_one_host_get_numbered_names() -> None:
    cpu = DeviceSpec("cpu").node_names("host")
    assert [next(cpu) for _ in range(4)] == ["cpu@host", "cpu.2@host", "cpu.3@host", "cpu.4@host"]
    gpus = DeviceSpec("cuda", (0, 1)).node_names("host")
    assert [next(gpus) for _ in range(3)] == ["gpu0-1@host", "gpu0-1.2@host", "gpu0-1.3@host"]


def test_only_a_hosts_further_cpu_workers_leave_their_engine_threads_unbound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(OMP_BIND_VARIABLE, raising=False)
    cpu = DeviceSpec("cpu")
    assert not unbind_extra_cpu_engine(cpu, "cpu@host", "host")
    assert not unbind_extra_cpu_engine(cpu, "victim@host", "host")  # a name given by hand
    assert not unbind_extra_cpu_engine(DeviceSpec("cuda", (0,)), "gpu0.2@host", "host")
    assert OMP_BIND_VARIABLE not in os.environ
    assert unbind_extra_cpu_engine(cpu, "cpu.2@host", "host")
    assert os.environ[OMP_BIND_VARIABLE] == "nobind"
    monkeypatch.setenv(OMP_BIND_VARIABLE, "1")  # a binding chosen by hand is kept
    assert not unbind_extra_cpu_engine(cpu, "cpu.3@host", "host")
    assert os.environ[OMP_BIND_VARIABLE] == "1"


@pytest.mark.parametrize("value", ["", "x", "0,0", "-1", "0,,a"])
def test_bad_gpu_lists_are_refused(value: str) -> None:
    with pytest.raises(ValueError):
        parse_gpus(value)


def test_gpu_lists_parse() -> None:
    assert parse_gpus("0") == (0,)
    assert parse_gpus("1, 3") == (1, 3)


@pytest.fixture
def children() -> Iterator[dict[str, subprocess.Popen[str]]]:
    started = {
        name: subprocess.Popen(
            [sys.executable, "-c", _CHILD, name], stdout=subprocess.PIPE, text=True
        )
        for name in (ENGINE_CORE_PROCESS, "VLLM::Worker")
    }
    for child in started.values():
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
    yield started
    for child in started.values():
        child.kill()
        child.wait()


def _nice_of_threads(pid: int) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_only_the_engine_core_is_niced_every_thread_of_it(
    children: dict[str, subprocess.Popen[str]],
) -> None:
    engine_core, forward_pass = children[ENGINE_CORE_PROCESS], children["VLLM::Worker"]
    assert len(os.listdir(f"/proc/{engine_core.pid}/task")) == 2

    assert lower_engine_core_priority(7) == [engine_core.pid]

    assert _nice_of_threads(engine_core.pid) == {7}
    assert _nice_of_threads(forward_pass.pid) == {os.getpriority(os.PRIO_PROCESS, 0)}
    # Another process's children are not touched.
    assert lower_engine_core_priority(9, parent=forward_pass.pid) == []
    assert _nice_of_threads(engine_core.pid) == {7}
