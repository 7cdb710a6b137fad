"""The import boundaries of DESIGN.md: a wrong import fails here, not in production."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("core", "api", "scheduler", "workers", "migrations")
PARTS = (*PRODUCT, "inferq", "bench")
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "api": {"core"},
    "scheduler": {"core"},
    "workers": {"core"},
    "migrations": {"core"},
    # The command line starts every process; the benchmarks drive all of them.
    "inferq": set(PRODUCT),
    "bench": {*PRODUCT, "inferq"},
}
GPU_STACK = {"vllm", "torch"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it (a lazy import is a dependency too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                module = _module_name(path)
                package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
                anchor = package.split(".")
                base = ".".join([*anchor[: len(anchor) - node.level + 1], *filter(None, [base])])
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def _project_modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for part in PARTS
        for path in sorted((ROOT / part).rglob("*.py"))
        if ".venv" not in path.parts
    }


def _violations(part: str, modules: dict[str, Path]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for module, path in modules.items()
        if module.split(".")[0] == part
        for name in sorted(_imported_modules(path))
        if (top := name.split(".")[0]) in (*PARTS, "tests")
        and top != part
        and top not in ALLOWED[part]
    ]


@pytest.mark.parametrize("part", PARTS)
def test_part_imports_only_what_design_allows(part: str) -> None:
    assert _violations(part, _project_modules()) == []


def test_the_boundary_check_catches_a_sibling_import() -> None:
    bad = ROOT / "api" / "_boundary_probe.py"
    bad.write_text("from workers.engine import VllmEngine\n")
    try:
        assert _violations("api", _project_modules()) == [
            "api/_boundary_probe.py imports workers.engine",
            "api/_boundary_probe.py imports workers.engine.VllmEngine",
        ]
    finally:
        bad.unlink()


def _cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Strongly connected groups of more than one module in the project's import graph."""
    graph = {
        module: sorted(
            name for name in _imported_modules(path) if name in modules and name != module
        )
        for module, path in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in graph:
        if module not in index:
            visit(module)
    return groups


def test_no_module_imports_itself_through_others() -> None:
    # A package's __init__ re-exporting its modules would not be a cycle of meaning.
    modules = {
        name: path for name, path in _project_modules().items() if path.name != "__init__.py"
    }
    assert _cycles(modules) == []


def test_the_cycle_check_finds_a_cycle(tmp_path: Path) -> None:
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text("import b\n")
    second.write_text("from a import x\n")
    assert _cycles({"a": first, "b": second}) == [["a", "b"]]


@pytest.mark.parametrize("part", ["api", "scheduler", "core"])
def test_api_and_scheduler_never_import_the_gpu_stack(part: str) -> None:
    offending = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / part).rglob("*.py"))
        for name in _imported_modules(path)
        if name.split(".")[0] in GPU_STACK
    ]
    assert offending == []


def test_loading_the_api_loads_no_gpu_stack() -> None:
    code = (
        "import sys, api.app, api.routes.jobs, core.queue.app, scheduler.reaper; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_modules_stay_small() -> None:
    big = [
        f"{path.relative_to(ROOT)}: {len(path.read_text().splitlines())} lines"
        for part in (*PRODUCT, "inferq")
        for path in (ROOT / part).rglob("*.py")
        if len(path.read_text().splitlines()) > 400
    ]
    assert big == []
