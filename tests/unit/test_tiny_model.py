"""The local model's tokenizer is byte-level: any text round-trips, one token per byte."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from core.modelinfo import load_model_info
from workers.model_init import is_model_dir
from workers.tiny_model import BYTE_TOKENS, build_tokenizer_json


def test_every_byte_is_one_token_plus_bos() -> None:
    tokenizer = Tokenizer.from_str(build_tokenizer_json())
    text = "naïve 漢字 🙂 \n\t"
    ids = tokenizer.encode(text).ids
    assert ids[0] == BYTE_TOKENS  # bos
    assert ids[1:] == list(text.encode())
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_model_info_reads_context_and_counts_tokens(model_dir: Path) -> None:
    assert is_model_dir(model_dir)
    info = load_model_info(str(model_dir), None)
    assert info.max_model_len == 16384
    assert info.count_tokens("héllo") == len("héllo".encode()) + 1
    assert load_model_info(str(model_dir), 512).max_model_len == 512
