"""What the API needs to know of the model without loading it: its served name, context
length, chat template and token counts; and the manifest `inferq model init` writes beside it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

MANIFEST_FILE = "inferq-model.json"
"""Written last by `inferq model init` into the model's directory: a directory with it is whole."""


@dataclass(frozen=True)
class ModelManifest:
    """Where a model made by `inferq model init` came from, and the name clients see it by.

    `kind` is `demo` (the real instruct model) or `tiny` (random weights, for fast tests);
    `sha256` is that of the file it was made from (empty for the tiny model).
    """

    name: str
    kind: str
    source: str
    sha256: str = ""

    def write(self, directory: Path) -> None:
        """Save as the directory's manifest."""
        fields = {"name": self.name, "kind": self.kind, "source": self.source}
        (directory / MANIFEST_FILE).write_text(json.dumps({**fields, "sha256": self.sha256}))

    @classmethod
    def read(cls, directory: Path) -> ModelManifest | None:
        """The directory's manifest; None when there is none (or it is not one of ours)."""
        try:
            data = json.loads((directory / MANIFEST_FILE).read_text())
            return cls(str(data["name"]), str(data["kind"]), str(data["source"]), data["sha256"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


def served_model_name(model: str, configured: str | None = None) -> str:
    """The name clients use for `model` (a directory or a hub id); never a path on disk.

    The configured name wins; then the manifest's; then a directory's own name; a hub id is
    its own name (as vLLM's `--served-model-name` defaults to it).
    """
    if configured:
        return configured
    path = Path(model)
    if not path.is_dir():
        return model
    manifest = ModelManifest.read(path)
    return manifest.name if manifest is not None else path.resolve().name


@dataclass
class ModelInfo:
    """The model's name, context length and tokenizer (from tokenizer.json, no torch needed).

    `chat_template` is the Jinja template of its tokenizer (None when it has none), rendered with
    `special_tokens` (bos_token, eos_token, ...); `created` is when its files were written.
    """

    name: str
    max_model_len: int
    tokenizer: Tokenizer
    chat_template: str | None = None
    special_tokens: dict[str, str] | None = None
    created: int = 0

    def count_tokens(self, text: str) -> int:
        """Prompt tokens as the engine will count them, special tokens included."""
        return len(self.tokenizer.encode(text, add_special_tokens=True).ids)


_TOKENIZER_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]


def _resolve_files(model: str) -> Path:
    path = Path(model)
    if path.is_dir():
        return path
    # A hub id: use the files already in the local Hugging Face cache (or fetch them if online).
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=_TOKENIZER_FILES))


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _chat_template(files: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The tokenizer's chat template: chat_template.jinja, else tokenizer_config.json's."""
    template_file = files / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


def load_model_info(
    model: str, max_model_len: int | None, served_name: str | None = None
) -> ModelInfo:
    """Read config.json, tokenizer.json and tokenizer_config.json of `model` (a dir or hub id).

    The info's `name` is the served name (see `served_model_name`).
    """
    files = _resolve_files(model)
    config_file = files / "config.json"
    config = json.loads(config_file.read_text())
    context = max_model_len or int(
        config.get("max_position_embeddings") or config.get("n_positions") or 2048
    )
    tokenizer = Tokenizer.from_file(str(files / "tokenizer.json"))
    config_path = files / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    special = {
        name: text
        for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        if (text := _token_text(tokenizer_config.get(name))) is not None
    }
    return ModelInfo(
        name=served_model_name(model, served_name),
        max_model_len=context,
        tokenizer=tokenizer,
        chat_template=_chat_template(files, tokenizer_config),
        special_tokens=special,
        created=int(config_file.stat().st_mtime),
    )


@dataclass
class ServedModels:
    """Every base model a deployment serves: the first (`INFERQ_MODEL`) and `others`
    (`INFERQ_MODELS`), by served name. A registered adapter runs on the first."""

    first: ModelInfo
    others: dict[str, ModelInfo]

    def of(self, name: str | None) -> ModelInfo:
        """The model a job that names `name` runs on (its adapter's base for an adapter)."""
        return self.others.get(name, self.first) if name is not None else self.first

    def names(self) -> list[str]:
        """The served names, the first model's first."""
        return [self.first.name, *sorted(self.others)]


def load_served_models(
    first: str, first_name: str | None, others: dict[str, str], max_model_len: int | None
) -> ServedModels:
    """`load_model_info` of every served model (`others`: served name to id or directory)."""
    return ServedModels(
        load_model_info(first, max_model_len, first_name),
        {name: load_model_info(path, max_model_len, name) for name, path in others.items()},
    )
