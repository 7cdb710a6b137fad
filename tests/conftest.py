"""Fixtures shared by every test layer."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small local model, made once per test session."""
    from workers.tiny_model import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("model"))
