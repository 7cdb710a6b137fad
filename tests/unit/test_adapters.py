"""The adapter registry (on a real SQLite file) and how a worker resolves a job's model."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.adapters import AdapterExists, AdapterStore
from core.db import Database
from core.errors import InvalidRequest
from core.models import Job
from migrations import upgrade
from workers.adapters import JobAdapters
from workers.tiny_model import init_tiny_adapter


@pytest.fixture
def store(tmp_path: Path) -> AdapterStore:
    url = f"sqlite:///{tmp_path / 'inferq.db'}"
    upgrade(url)
    return AdapterStore(Database(url))


def test_an_adapter_is_checked_when_it_is_registered(store: AdapterStore, tmp_path: Path) -> None:
    adapter = init_tiny_adapter(tmp_path / "a", rank=8)
    assert store.add("a", adapter, max_rank=16).rank == 8
    with pytest.raises(AdapterExists):
        store.add("a", adapter)
    with pytest.raises(InvalidRequest, match="rank 8 is over"):
        store.add("b", adapter, max_rank=4)
    with pytest.raises(InvalidRequest, match="not a LoRA adapter"):
        store.add("c", tmp_path)  # a directory without adapter_config.json
    with pytest.raises(InvalidRequest, match="absolute"):
        store.add("d", Path("relative/adapter"))
    with pytest.raises(InvalidRequest, match="Bad adapter name"):
        store.add("e/f", adapter)
    assert [a.name for a in store.all()] == ["a"]


def test_a_name_registered_again_is_a_new_adapter(store: AdapterStore, tmp_path: Path) -> None:
    first = store.add("a", init_tiny_adapter(tmp_path / "one"))
    assert store.remove("a") and not store.remove("a")
    second = store.add("a", init_tiny_adapter(tmp_path / "two", seed=2))
    assert second.id != first.id and second.path.endswith("two")
    assert store.named(["a", "unknown"]) == {"a": second}


def test_a_worker_runs_the_base_model_names_and_refuses_what_it_cannot_serve(
    store: AdapterStore, tmp_path: Path
) -> None:
    adapter = store.add("kept", init_tiny_adapter(tmp_path / "kept"))
    jobs = [
        Job(id="base", model="tiny"),
        Job(id="old", model=None),  # stored before jobs named a model
        Job(id="adapted", model="kept"),
        Job(id="removed", model="gone"),
    ]
    adapters, refused = JobAdapters(store, "tiny", enabled=True).resolve(jobs)
    assert adapters == {"adapted": adapter}
    assert {job_id: r.error_code for job_id, r in refused.items()} == {"removed": "model_not_found"}

    adapters, refused = JobAdapters(store, "tiny", enabled=False).resolve(jobs)
    assert adapters == {}
    assert {job_id: r.error_code for job_id, r in refused.items()} == {
        "adapted": "model_not_served",
        "removed": "model_not_served",
    }


def test_a_job_of_another_base_model_is_refused_with_where_it_runs(
    store: AdapterStore, tmp_path: Path
) -> None:
    adapter = store.add("kept", init_tiny_adapter(tmp_path / "kept"))
    jobs = [Job(id="adapted", model="kept"), Job(id="other", model="smol")]
    adapters, refused = JobAdapters(store, "tiny", True, others={"smol"}).resolve(jobs)
    assert adapters == {"adapted": adapter}
    assert refused["other"].error_code == "model_not_served"
    assert "'smol' runs on other workers" in refused["other"].message
