"""docker-compose.yml cannot be run here (no Docker engine), so it is checked by parsing."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import yaml

from core.settings import Settings
from inferq.cli import main

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
INFERQ_SERVICES = {n: s for n, s in SERVICES.items() if s.get("image", "").startswith("inferq")}


def _resolve(args: list[str]) -> click.Command:
    """The CLI command `inferq ARGS` would run, its options parsed (bad ones raise)."""
    command: click.Command = main
    while isinstance(command, click.Group):
        name, *args = args
        found = command.get_command(click.Context(command), name)
        assert found is not None, f"unknown command {name!r}"
        command = found
    command.make_context(command.name or "", list(args))
    return command


def test_every_inferq_service_runs_a_real_cli_command() -> None:
    assert {"api", "migrate", "scheduler", "flower", "worker-gpu0"} <= set(INFERQ_SERVICES)
    for service in INFERQ_SERVICES.values():
        command = service["command"]
        _resolve(command if isinstance(command, list) else shlex.split(command))


def test_every_inferq_variable_is_a_real_setting() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    names = set(re.findall(r"\b(INFERQ_[A-Z_]+)\s*:", text))
    fields = {f"INFERQ_{name.upper()}" for name in Settings.model_fields}
    assert names and names <= fields, names - fields


def test_every_gpu_worker_reserves_its_device() -> None:
    workers = {n: s for n, s in INFERQ_SERVICES.items() if s["command"][0] == "worker"}
    assert workers
    for name, service in workers.items():
        gpus = service["command"][service["command"].index("--gpus") + 1].split(",")
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["device_ids"] == gpus, name


def test_redis_requires_a_password_and_is_not_published() -> None:
    redis = SERVICES["redis"]
    assert "--requirepass" in redis["command"]
    assert "ports" not in redis


def _defined_metric_samples() -> set[str]:
    """Every sample name the code's metrics can expose (`_bucket`, `_total`, … included)."""
    from prometheus_client import REGISTRY

    import core.metrics

    del core.metrics  # imported for its registrations
    return {
        sample.name
        for family in REGISTRY.collect()
        if family.name.startswith("inferq_")
        for sample in family.samples
    } | {
        f"{family.name}{suffix}"
        for family in REGISTRY.collect()
        if family.name.startswith("inferq_")
        for suffix in ("_bucket", "_count", "_sum", "_total", "")
    }


def test_every_dashboard_panel_queries_metrics_the_code_defines() -> None:
    import json

    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/inferq.json").read_text())
    defined = _defined_metric_samples()
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert any("TTFT" in title for title in titles)
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\binferq_[a-z_]+", target["expr"]))
            assert used, target["expr"]
            assert used <= defined, (panel["title"], used - defined)


def test_prometheus_scrapes_the_api_every_worker_and_the_scheduler() -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    targets = {
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    workers = [n for n, s in INFERQ_SERVICES.items() if s["command"][0] == "worker"]
    expected = {"api:8000", "scheduler:9102"} | {f"{name}:9101" for name in workers}
    assert expected <= targets
    for mount in SERVICES["prometheus"]["volumes"] + SERVICES["grafana"]["volumes"]:
        source = mount.split(":")[0]
        if source.startswith("./"):
            assert (ROOT / source).exists(), source


def test_flower_requires_credentials() -> None:
    assert "INFERQ_FLOWER_BASIC_AUTH" in SERVICES["flower"]["environment"]
