"""`inferq model init`: make the demo model (or the tiny one) in a directory, whole or not at all.

The model is built in a hidden directory beside the target and moved into place only once it is
complete, its manifest written last; a failure or an interrupt removes what was built, so a
directory either holds a whole model or is left as it was.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from core.modelinfo import MANIFEST_FILE, ModelManifest
from workers.demo_model import ModelInitError, Progress, init_demo_model
from workers.tiny_model import init_tiny_model

__all__ = ["ModelInitError", "init_model", "is_model_dir"]


def is_model_dir(directory: Path) -> bool:
    """Whether `directory` holds a whole model: one `inferq model init` finished (its manifest
    is written last), or one made elsewhere (a config and a tokenizer)."""
    if (directory / MANIFEST_FILE).is_file():
        return True
    return (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()


def describe(directory: Path) -> str:
    """What a model directory holds, in a few words."""
    manifest = ModelManifest.read(directory)
    if manifest is None:
        return "a model not made by inferq" if is_model_dir(directory) else "other files"
    return f"{manifest.name} ({manifest.kind})"


@contextmanager
def _built_in_place(directory: Path) -> Iterator[Path]:
    """A fresh hidden directory to build in, moved to `directory` when the block succeeds."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
    partial.chmod(0o755)  # mkdtemp makes it private; a model directory is not
    try:
        yield partial
        if directory.exists():
            replaced = partial.with_name(partial.name.replace(".partial-", ".replaced-"))
            directory.rename(replaced)
            partial.rename(directory)
            shutil.rmtree(replaced)
        else:
            partial.rename(directory)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def init_model(
    directory: Path,
    *,
    tiny: bool = False,
    from_file: Path | None = None,
    force: bool = False,
    progress: Progress = lambda _line: None,
) -> ModelManifest:
    """Make the demo model (or with `tiny`, the random-weight one) in `directory`.

    Idempotent: a directory that already holds the model asked for is left alone. A directory
    that holds anything else is replaced only with `force`. Raises ModelInitError.
    """
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' progress bars, in a CLI's output
    kind = "tiny" if tiny else "demo"
    existing = ModelManifest.read(directory)
    if existing is not None and existing.kind == kind and not force:
        progress(f"{directory} already holds {existing.name}")
        return existing
    if directory.exists() and any(directory.iterdir()) and not force:
        raise ModelInitError(
            f"{directory} already holds {describe(directory)}; pass --force to replace it"
        )
    if tiny and from_file is not None:
        raise ModelInitError("--tiny makes random weights; it takes no --from-file")
    with _built_in_place(directory) as partial:
        if tiny:
            progress("writing the tiny random-weight model …")
            init_tiny_model(partial)
        else:
            init_demo_model(partial, from_file, progress)
    manifest = ModelManifest.read(directory)
    assert manifest is not None
    progress(f"ready: {manifest.name} in {directory}")
    return manifest
