"""A shared prefix is tokenized once per worker, and the ids are those of the whole prompt."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from workers.prompt_ids import PrefixTokens
from workers.tiny_model import build_tokenizer_json


class _Counting:
    """A Hugging Face tokenizer that counts the characters it is given to encode."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.chars = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.chars += len(text)
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return ids


class _Words:
    """Word-level ids (a word cut in two is two other words), with a BOS id of 0."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [hash(word) % 1000 + 1 for word in text.split()]
        return [0, *ids] if add_special_tokens else ids


def test_the_prefix_is_tokenized_with_the_first_prompt_only_and_the_ids_are_the_whole_prompts() -> (
    None
):
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(build_tokenizer_json()))
    counting = _Counting(hf)
    tokens = PrefixTokens(counting)
    document = "Document: the river floods every spring, and the town moves uphill. " * 20
    rests = [f"Question {i}: when does the river flood?" for i in range(50)]
    for rest in rests:
        whole = hf.encode(document + rest, add_special_tokens=True)
        assert tokens.ids(document, rest, len(whole)) == whole
    # The first prompt is checked whole; after that only each rest is tokenized.
    assert counting.chars == 2 * len(document) + 2 * len(rests[0]) + sum(map(len, rests[1:]))


def _whole(text: str) -> tuple[list[int], int]:
    ids = _Words().encode(text)
    return ids, len(ids)


def test_a_prefix_whose_parts_tokenize_differently_is_left_to_the_engine() -> None:
    tokens = PrefixTokens(_Words())
    whole, count = _whole("the document ends here. Why?")
    assert tokens.ids("the document en", "ds here. Why?", count) == whole  # checked whole
    assert (
        tokens.ids("the document en", "ds there. How?", _whole("the document ends there. How?")[1])
        is None
    )
    assert tokens.ids("the document ", "ends here. Why?", count) == whole  # cut between words
    assert (
        tokens.ids("the document ", "ends there.", _whole("the document ends there.")[1])
        == (_whole("the document ends there.")[0])
    )


def test_ids_of_another_length_than_the_apis_count_are_not_used() -> None:
    """A prefix that split well for the first question may not for a later one, whose text
    joins the prefix's last word: the API counted that prompt whole."""
    tokens = PrefixTokens(_Words())
    whole, count = _whole("the document ends here.")
    assert tokens.ids("the document", " ends here.", count) == whole
    assert tokens.ids("the document", "s end.", _whole("the documents end.")[1]) is None
    assert tokens.ids("the document", " ends here.", None) is None  # no count: the engine's
