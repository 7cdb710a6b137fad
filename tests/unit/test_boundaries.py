"""The import boundaries of DESIGN.md: a wrong import fails here, not in production."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("core", "api", "scheduler", "workers", "migrations")
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "api": {"core", "scheduler"},
    "scheduler": {"core"},
    "workers": {"core", "scheduler"},
    "migrations": {"core"},
}
GPU_STACK = {"vllm", "torch"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("part", PARTS)
def test_part_imports_only_what_design_allows(part: str) -> None:
    violations = []
    for path in sorted((ROOT / part).rglob("*.py")):
        for name in _imports(path) & set(PARTS):
            if name != part and name not in ALLOWED[part]:
                violations.append(f"{path.relative_to(ROOT)} imports {name}")
    assert violations == []


@pytest.mark.parametrize("part", ["api", "scheduler", "core"])
def test_api_and_scheduler_never_import_the_gpu_stack(part: str) -> None:
    offending = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / part).rglob("*.py"))
        for name in _imports(path) & GPU_STACK
    ]
    assert offending == []


def test_loading_the_api_loads_no_gpu_stack() -> None:
    code = (
        "import sys, api.app, api.routes.jobs, scheduler.queues; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_modules_stay_small() -> None:
    big = [
        f"{path.relative_to(ROOT)}: {len(path.read_text().splitlines())} lines"
        for part in (*PARTS, "inferq")
        for path in (ROOT / part).rglob("*.py")
        if len(path.read_text().splitlines()) > 400
    ]
    assert big == []
