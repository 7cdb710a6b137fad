"""What the API needs to know of the model without loading it: context length and token counts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer


@dataclass
class ModelInfo:
    """The model's name, context length and tokenizer (from tokenizer.json, no torch needed)."""

    name: str
    max_model_len: int
    tokenizer: Tokenizer

    def count_tokens(self, text: str) -> int:
        """Prompt tokens as the engine will count them, special tokens included."""
        return len(self.tokenizer.encode(text, add_special_tokens=True).ids)


def _resolve_files(model: str) -> Path:
    path = Path(model)
    if path.is_dir():
        return path
    # A hub id: use the files already in the local Hugging Face cache (or fetch them if online).
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["config.json", "tokenizer.json"]))


def load_model_info(model: str, max_model_len: int | None) -> ModelInfo:
    """Read config.json and tokenizer.json of `model` (a directory or a hub id)."""
    files = _resolve_files(model)
    config = json.loads((files / "config.json").read_text())
    context = max_model_len or int(
        config.get("max_position_embeddings") or config.get("n_positions") or 2048
    )
    tokenizer = Tokenizer.from_file(str(files / "tokenizer.json"))
    return ModelInfo(name=model, max_model_len=context, tokenizer=tokenizer)
