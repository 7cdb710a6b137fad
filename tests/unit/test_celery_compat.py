"""The pins and the start-up check that keep inferq's Celery adaptations on tested ground."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from kombu.transport import redis as redis_transport
from kombu.transport.virtual import base as virtual_base
from packaging.requirements import Requirement

from core import celery_compat
from core.celery_compat import PRIVATE_NAMES, UntestedCeleryError, check, problems
from core.queue.app import make_celery_app
from core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _requirement(name: str) -> Requirement:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = [Requirement(text) for text in pyproject["project"]["dependencies"]]
    return next(req for req in found if req.name == name)


@pytest.mark.parametrize("package", ["celery", "kombu"])
def test_the_next_minor_release_is_refused_by_the_pins(package: str) -> None:
    installed = version(package)
    major, minor = (int(part) for part in installed.split(".")[:2])
    specifier = _requirement(package).specifier
    assert specifier.contains(installed)
    assert not specifier.contains(f"{major}.{minor + 1}.0")
    assert celery_compat.TESTED_SERIES[package] == f"{major}.{minor}"


def test_constraints_pin_the_versions_installed_here() -> None:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    assert pins["celery"] == version("celery")
    assert pins["kombu"] == version("kombu")
    differing = {name: pin for name, pin in pins.items() if version(name) != pin}
    assert differing == {}, "run scripts/lock.py after changing dependencies"


def test_every_private_name_inferq_relies_on_is_present() -> None:
    assert problems() == []


def test_a_changed_attribute_stops_start_up_with_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(redis_transport.Channel, "_brpop_read")
    with pytest.raises(UntestedCeleryError) as raised:
        check("inferq", PRIVATE_NAMES)
    message = str(raised.value)
    assert "kombu.transport.redis.Channel._brpop_read (used by workers.edge) is gone" in message
    assert "INFERQ_CELERY_MODE=stock" in message
    check("stock", PRIVATE_NAMES)  # the stock mode needs none of them


def test_a_renamed_instance_attribute_is_noticed() -> None:
    renamed = celery_compat.PrivateName(
        "kombu.transport.virtual.base:QoS", "_delivered_messages", "workers.edge", instance=True
    )
    kept = celery_compat.PrivateName(
        "kombu.transport.virtual.base:QoS", "_delivered", "workers.edge", instance=True
    )
    assert hasattr(virtual_base, "QoS")
    assert not renamed.present()
    assert kept.present()


def test_an_untested_series_stops_the_app_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(celery_compat, "version", lambda name: "9.1.0")
    celery_compat._installed_problems.cache_clear()
    try:
        with pytest.raises(UntestedCeleryError, match=r"celery 9\.1\.0 is not the tested 5\.7\.x"):
            make_celery_app(Settings())
        make_celery_app(Settings(celery_mode="stock"))
    finally:
        monkeypatch.undo()
        celery_compat._installed_problems.cache_clear()
