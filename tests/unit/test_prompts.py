"""A batch's shared prompt beginning: split off once, and every job's count still exact."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from core.modelinfo import ModelInfo
from core.prompts import (
    MIN_SHARED_CHARS,
    count_prompts,
    count_with_head,
    text_digest,
    whole_digests,
)

DOCUMENT = " ".join(f"Clause {i}: the tenant pays rent on day {i % 28 + 1}." for i in range(80))


def _model(post: str | None = None) -> ModelInfo:
    """A byte-level BPE tokenizer (as GPT-2's and Llama 3's) trained here on the document."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([DOCUMENT, "Question: When is rent due? Answer:"], trainer)
    if post is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=post, special_tokens=[("<s>", 0), ("</s>", 1)]
        )
    return ModelInfo(name="bpe", max_model_len=100_000, tokenizer=tokenizer)


def _whole(model: ModelInfo, prompts: list[str]) -> list[int]:
    return [model.count_tokens(prompt) for prompt in prompts]


def test_prompts_sharing_a_document_store_it_once_with_exact_counts() -> None:
    model = _model(post="<s> $A")
    prompts = [f"{DOCUMENT}\n\nQuestion: When is clause {i} due?\nAnswer:" for i in range(50)]
    counted = count_prompts(model, prompts)
    assert counted.prefix is not None
    assert len(counted.prefix.text) >= max(MIN_SHARED_CHARS, len(DOCUMENT))  # the document's in
    assert [counted.prefix.text + rest for rest in counted.rests] == prompts
    assert counted.tokens == _whole(model, prompts)
    assert counted.prefix.tokens == counted.tokens[0] - len(
        model.tokenizer.encode(counted.rests[0], add_special_tokens=False).ids
    )


def test_a_tokenizer_that_counts_differently_across_the_cut_gets_every_prompt_counted_whole() -> (
    None
):
    # An end-of-sequence token after every prompt: the prefix and rest counts miss it.
    model = _model(post="<s> $A </s>")
    tails = [f"\n\nQuestion: When is clause {i} due?" for i in range(5)]
    counted = count_with_head(model, DOCUMENT, tails)
    prompts = [DOCUMENT + tail for tail in tails]
    assert counted.prefix is not None
    assert [counted.prefix.text + rest for rest in counted.rests] == prompts
    assert counted.tokens == _whole(model, prompts)


def test_short_or_unshared_prompts_are_kept_whole() -> None:
    model = _model()
    short = ["Question: When is rent due?", "Question: When is rent paid?"]
    different = [DOCUMENT, "x" + DOCUMENT]
    for prompts in (short, different, [DOCUMENT]):
        counted = count_prompts(model, prompts)
        assert counted.prefix is None
        assert counted.rests == prompts
        assert counted.tokens == _whole(model, prompts)


def test_a_prompt_is_named_by_the_same_digest_whether_its_prefix_is_stored_or_not() -> None:
    model = _model()
    prompts = [f"{DOCUMENT}\n\nQuestion {i}: when is it due? ü 漢字" for i in range(3)]
    shared = count_prompts(model, prompts)
    alone = count_prompts(model, prompts[:1])
    assert shared.prefix is not None and alone.prefix is None
    assert [digest() for digest in whole_digests(shared)] == [text_digest(p) for p in prompts]
    assert [digest() for digest in whole_digests(alone)] == [text_digest(prompts[0])]
