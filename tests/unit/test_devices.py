"""Device pinning and worker names."""

from __future__ import annotations

import pytest

from workers.devices import DeviceSpec, parse_gpus


def test_node_names_follow_the_devices() -> None:
    assert DeviceSpec("cuda", (0,)).node_name("host") == "gpu0@host"
    assert DeviceSpec("cuda", (2, 3)).node_name("host") == "gpu2-3@host"
    assert DeviceSpec("cpu").node_name("host") == "cpu@host"


@pytest.mark.parametrize("value", ["", "x", "0,0", "-1", "0,,a"])
def test_bad_gpu_lists_are_refused(value: str) -> None:
    with pytest.raises(ValueError):
        parse_gpus(value)


def test_gpu_lists_parse() -> None:
    assert parse_gpus("0") == (0,)
    assert parse_gpus("1, 3") == (1, 3)
