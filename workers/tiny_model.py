"""The tiny model: a small Llama-architecture model with random weights and a byte tokenizer.

It exists for fast tests and for measuring the queue's own cost: made in a second with no
download, it runs the real vLLM engine about 20 times faster than the demo model
(`workers.demo_model`). Its output is noise, but its shapes, tokenizer and speed are real.
`inferq model init --tiny` makes it.

Prompts may hold any UTF-8 (every byte is a token), but the model writes printable ASCII,
newlines and, rarely, end-of-sequence: one hidden channel carries a constant that the output
layer turns into a strong preference for those tokens. Unshaped, a random model writes stray
high bytes that never form valid UTF-8, and its text would stay empty.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.modelinfo import ModelManifest

TINY_MODEL_NAME = "inferq-tiny"
"""The tiny model's served name."""

BYTE_TOKENS = 256
BOS, EOS, UNK = "<s>", "</s>", "<unk>"

# Sizes known to work on vLLM's CPU attention backend (head_dim 64; 16 fails there).
HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 2
NUM_KV_HEADS = 1
INTERMEDIATE_SIZE = 256
MAX_POSITIONS = 16384


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


def init_tiny_model(directory: Path, *, seed: int = 0) -> Path:
    """Write the model (config, random weights, tokenizer, manifest) into `directory`."""
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
    _shape_output(model)
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
    ModelManifest(TINY_MODEL_NAME, "tiny", f"random weights, seed {seed}").write(directory)
    return directory


WRITABLE_BYTES = (0x0A, *range(0x20, 0x7F))
"""What the model writes: newline and printable ASCII."""
_CONSTANT_CHANNEL = 0
_CONSTANT = 4.0


def _shape_output(model: Any) -> None:
    """Make the model prefer writable bytes (and end-of-sequence, less) over every other token."""
    import torch

    with torch.no_grad():
        # Every token's embedding carries a large constant in one channel, so after the final
        # RMS norm that channel is large and positive whatever the random layers add...
        model.model.embed_tokens.weight[:, _CONSTANT_CHANNEL] = _CONSTANT
        # ...and the output layer reads it as +1 for writable tokens, -1 for the rest.
        preference = model.lm_head.weight[:, _CONSTANT_CHANNEL]
        preference.fill_(-1.0)
        preference[list(WRITABLE_BYTES)] = 1.0
        preference[BYTE_TOKENS + 1] = 0.8  # end-of-sequence: possible, but rare


ADAPTER_TARGETS = ("q_proj", "v_proj")


def init_tiny_adapter(directory: Path, *, seed: int = 1, rank: int = 8) -> Path:
    """Write a LoRA adapter of the tiny model (PEFT's layout, random weights) into `directory`.

    Its weights are large enough to change what the model writes: a test of adapters can tell
    an adapted job's text from the base model's.
    """
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    head_dim = HIDDEN_SIZE // NUM_HEADS
    out_features = {"q_proj": NUM_HEADS * head_dim, "v_proj": NUM_KV_HEADS * head_dim}
    weights = {}
    for layer in range(NUM_LAYERS):
        for target in ADAPTER_TARGETS:
            name = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            a = torch.randn(rank, HIDDEN_SIZE, generator=generator) * 0.5
            b = torch.randn(out_features[target], rank, generator=generator) * 0.5
            weights[f"{name}.lora_A.weight"], weights[f"{name}.lora_B.weight"] = a, b
    save_file(weights, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(ADAPTER_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": TINY_MODEL_NAME,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory
