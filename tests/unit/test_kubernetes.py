"""deploy/kubernetes cannot be applied here (no cluster), so it is validated offline: core
resources against Kubernetes' own schemas (kubernetes-validate), KEDA's against the fields of
its v2 API that the manifests use, and both against inferq's code (commands, settings, ports,
probe paths, the Redis keys and metric the autoscaling reads)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from core import keys
from core.metrics import QUEUE_LENGTH
from core.settings import Settings
from core.tiers import DEFAULT_TIER_POLICIES, TIERS_BY_PRIORITY, Tier
from tests.unit.test_deployment import _resolve

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.30.0"
KEDA = "keda.sh/v1alpha1"

DOCUMENTS: list[tuple[str, dict[str, Any]]] = [
    (path.name, document)
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml"))
    for document in yaml.safe_load_all(path.read_text())
    if document
]
RESOURCES = {(doc["kind"], doc["metadata"]["name"]): doc for _, doc in DOCUMENTS}


def _of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {name: doc for (k, name), doc in RESOURCES.items() if k == kind}


def _containers(kinds: tuple[str, ...] = ("Deployment", "Job")) -> list[dict[str, Any]]:
    return [
        container
        for kind in kinds
        for doc in _of_kind(kind).values()
        for container in doc["spec"]["template"]["spec"]["containers"]
    ]


_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_REF = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "kind": {"type": "string"}},
    "additionalProperties": False,
}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "labels": _STRINGS, "annotations": _STRINGS},
    "additionalProperties": False,
}
# The parts of KEDA v2's ScaledObject and TriggerAuthentication that inferq uses, after KEDA's
# API reference (keda.sh/docs/2.x/reference/scaledobject-spec): unknown fields are refused, so a
# misspelt one fails here instead of being dropped by the cluster.
KEDA_SCHEMAS: dict[str, dict[str, Any]] = {
    "ScaledObject": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": KEDA},
            "kind": {"const": "ScaledObject"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "required": ["scaleTargetRef", "triggers"],
                "properties": {
                    "scaleTargetRef": {
                        **_REF,
                        "properties": {**_REF["properties"], "apiVersion": {"type": "string"}},
                    },
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "pollingInterval": {"type": "integer", "minimum": 1},
                    "cooldownPeriod": {"type": "integer", "minimum": 0},
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["type", "metadata"],
                            "properties": {
                                "type": {"type": "string"},
                                "name": {"type": "string"},
                                "metadata": _STRINGS,
                                "authenticationRef": _REF,
                                "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            },
                            "additionalProperties": False,
                        },
                    },
                },
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    },
    "TriggerAuthentication": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": KEDA},
            "kind": {"const": "TriggerAuthentication"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "properties": {
                    "secretTargetRef": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["parameter", "name", "key"],
                            "properties": {
                                "parameter": {"type": "string"},
                                "name": {"type": "string"},
                                "key": {"type": "string"},
                            },
                            "additionalProperties": False,
                        },
                    }
                },
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    },
}
# What each KEDA scaler inferq uses requires (keda.sh/docs/2.x/scalers/redis-lists, prometheus).
TRIGGER_METADATA = {
    "redis": {"address", "listName", "listLength"},
    "prometheus": {"serverAddress", "query", "threshold"},
}


@pytest.mark.parametrize(("source", "document"), DOCUMENTS, ids=[n for n, _ in DOCUMENTS])
def test_every_resource_validates(source: str, document: dict[str, Any]) -> None:
    if document["apiVersion"] == KEDA:
        jsonschema.validate(document, KEDA_SCHEMAS[document["kind"]])
        for trigger in document["spec"].get("triggers", []):
            assert TRIGGER_METADATA[trigger["type"]] <= set(trigger["metadata"]), trigger
    else:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_takes_every_manifest_and_the_grafana_dashboard() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    files = {f"kubernetes/{p.name}" for p in (DEPLOY / "kubernetes").glob("*.yaml")}
    assert set(kustomization["resources"]) == files
    for generator in kustomization["configMapGenerator"]:
        for name in generator["files"]:
            assert (DEPLOY / name).is_file(), name


def test_every_container_runs_a_real_command_with_real_settings() -> None:
    fields = {f"INFERQ_{name.upper()}" for name in Settings.model_fields}
    config = _of_kind("ConfigMap")["inferq-config"]["data"]
    secret = _of_kind("Secret")["inferq-secrets"]["stringData"]
    assert {name for name in [*config, *secret] if name.startswith("INFERQ_")} <= fields
    for container in _containers():
        _resolve(list(container["args"]))
        sources = {
            ref.get("configMapRef", ref.get("secretRef"))["name"] for ref in container["envFrom"]
        }
        assert sources == {"inferq-config", "inferq-secrets"}, container["name"]


def _probe_paths(container: dict[str, Any]) -> dict[str, tuple[str, int]]:
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    return {
        probe: (spec["httpGet"]["path"], ports[spec["httpGet"]["port"]])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe")
        if (spec := container.get(probe)) and "httpGet" in spec
    }


def test_probes_ask_the_real_endpoints() -> None:
    from api.app import app

    settings = Settings()
    routes = {getattr(route, "path", "") for route in app.routes}
    (api,) = _of_kind("Deployment")["inferq-api"]["spec"]["template"]["spec"]["containers"]
    assert _probe_paths(api) == {
        "readinessProbe": ("/readyz", 8000),
        "livenessProbe": ("/healthz", 8000),
    }
    assert {"/readyz", "/healthz"} <= routes
    (scheduler,) = _of_kind("Deployment")["inferq-scheduler"]["spec"]["template"]["spec"][
        "containers"
    ]
    port = settings.scheduler_metrics_port
    assert _probe_paths(scheduler) == {
        "readinessProbe": ("/readyz", port),
        "livenessProbe": ("/healthz", port),
    }
    for container in _containers():
        if container["args"][0] == "worker":
            paths = _probe_paths(container)
            assert {port for _, port in paths.values()} == {settings.worker_metrics_port}
            assert paths["livenessProbe"][0] == "/healthz"
            assert paths["readinessProbe"][0] == paths["startupProbe"][0] == "/readyz"


def _worker_tiers(deployment: dict[str, Any]) -> list[Tier]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = list(container["args"])
    return [Tier(value) for value in args[args.index("--tiers") + 1].split(",")]


def test_each_tier_has_a_worker_pool_that_takes_it_first() -> None:
    pools = {
        name: doc
        for name, doc in _of_kind("Deployment").items()
        if doc["spec"]["template"]["spec"]["containers"][0]["args"][0] == "worker"
    }
    assert set(pools) == {f"inferq-worker-{tier.value}" for tier in TIERS_BY_PRIORITY}
    for tier in TIERS_BY_PRIORITY:
        pool = pools[f"inferq-worker-{tier.value}"]
        taken = _worker_tiers(pool)
        assert taken[0] is tier and taken == sorted(taken, key=TIERS_BY_PRIORITY.index)
        spec = pool["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        args = shlex.join(container["args"])
        gpus = args.split("--gpus ")[1].split()[0].split(",")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == len(gpus), args
        # Time to finish what it runs when scaled down: the longest limit of its tiers.
        longest = max(DEFAULT_TIER_POLICIES[t].timeout_s for t in taken)
        assert spec["terminationGracePeriodSeconds"] >= longest


def test_autoscaling_reads_the_real_keys_of_each_tiers_waiting_work() -> None:
    scaled = _of_kind("ScaledObject")
    deployments = _of_kind("Deployment")
    assert set(_of_kind("TriggerAuthentication")) == {"inferq-redis"}
    secret = _of_kind("Secret")["inferq-secrets"]["stringData"]
    for ref in _of_kind("TriggerAuthentication")["inferq-redis"]["spec"]["secretTargetRef"]:
        assert ref["name"] == "inferq-secrets" and ref["key"] in secret
    assert {doc["spec"]["scaleTargetRef"]["name"] for doc in scaled.values()} == {
        f"inferq-worker-{tier.value}" for tier in TIERS_BY_PRIORITY
    }
    for doc in scaled.values():
        target = deployments[doc["spec"]["scaleTargetRef"]["name"]]
        tier = _worker_tiers(target)[0]  # the tier whose waiting work the pool is for
        triggers = {trigger["type"]: trigger for trigger in doc["spec"]["triggers"]}
        assert triggers["redis"]["metadata"]["listName"] == keys.queue_name(tier)
        assert triggers["redis"]["authenticationRef"]["name"] == "inferq-redis"
        query = triggers["prometheus"]["metadata"]["query"]
        assert query == f'max({QUEUE_LENGTH._name}{{tier="{tier.value}"}})'
    # Premium always has a worker; the basic pool scales to zero when idle.
    assert scaled["inferq-worker-premium"]["spec"]["minReplicaCount"] >= 1
    assert scaled["inferq-worker-basic"]["spec"]["minReplicaCount"] == 0
