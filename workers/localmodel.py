"""A small Llama-architecture model with random weights and a byte-level tokenizer.

It exists so that inferq runs the real vLLM engine where no model hub is reachable: laptops,
CI, air-gapped hosts. Its output is noise, but its shapes, tokenizer and speed are real.
"""

from __future__ import annotations

import json
from pathlib import Path

BYTE_TOKENS = 256
BOS, EOS, UNK = "<s>", "</s>", "<unk>"

# Sizes known to work on vLLM's CPU attention backend (head_dim 64; 16 fails there).
HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 2
NUM_KV_HEADS = 1
INTERMEDIATE_SIZE = 256
MAX_POSITIONS = 4096


def _byte_token(b: int) -> str:
    return f"<0x{b:02X}>"


def build_tokenizer_json() -> str:
    """A byte-fallback BPE tokenizer with no merges: one token per UTF-8 byte, plus bos/eos/unk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {_byte_token(b): b for b in range(BYTE_TOKENS)}
    vocab[BOS] = BYTE_TOKENS
    vocab[EOS] = BYTE_TOKENS + 1
    vocab[UNK] = BYTE_TOKENS + 2
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    from tokenizers import AddedToken

    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in (BOS, EOS, UNK)])
    return tokenizer.to_str()


def init_local_model(directory: Path, *, seed: int = 0) -> Path:
    """Write the model (config, random weights, tokenizer) into `directory`; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    vocab_size = BYTE_TOKENS + 3
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HIDDEN_SIZE // NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=BYTE_TOKENS,
        eos_token_id=BYTE_TOKENS + 1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)

    (directory / "tokenizer.json").write_text(build_tokenizer_json())
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "model_max_length": MAX_POSITIONS,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}, indent=2)
    )
    return directory


def is_model_dir(directory: Path) -> bool:
    """Whether `directory` already holds a model vLLM can load."""
    return (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()
