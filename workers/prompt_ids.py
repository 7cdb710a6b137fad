"""Token ids for prompts that begin with a shared prefix: the prefix tokenized once per worker.

A Q&A batch's questions share their document, stored once (`core.prompts`). Given the text,
vLLM's front end tokenizes every whole prompt in the worker's process: about 4 ms for a
1,500-token document on the 2-vCPU benchmark host, over a second of the worker's CPU for a
batch of 350 distinct questions, on the cores the engine needs. `PrefixTokens` tokenizes each
prefix once and each job's rest on its own, and the engine gets the ids
(`workers.engine`, a `TokensPrompt`).

The ids must be the ones the engine would have made from the text. The API cuts the prefix at a
token's start, a few tokens before the shared text ends, so that no token spans the cut, and
counts each prompt's tokens (whole, where the parts' count differed on the batch's first or last
prompt). Two checks here: the first prompt seen with a prefix is also tokenized whole, and a
prefix whose parts' ids differ from the whole's (a tokenizer that ends every text with a special
token, say) is left to the engine from then on; and ids whose length is not the API's count of
the prompt are not used (a later question whose text joins the prefix's last word). Where the
ids are not used, the engine tokenizes the text as before.

The first prompt of a prefix is tokenized on the engine's event loop (the prefix, the whole
prompt and the rest: about 10 ms for a 1,500-token document here), once per prefix per worker
while it stays among the `MAX_PREFIXES` most recently used; after that only each rest.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class PrefixTokens:
    """Each prompt's ids from its shared prefix's (cached) and its rest's; see the module."""

    MAX_PREFIXES = 64

    def __init__(self, tokenizer: Any) -> None:
        self._encode = tokenizer.encode
        # Each prefix's ids, with the tokenizer's special tokens; None: tokenize whole.
        self._heads: OrderedDict[str, list[int] | None] = OrderedDict()

    def ids(self, prefix: str, rest: str, tokens: int | None) -> list[int] | None:
        """The ids of `prefix + rest` as the engine tokenizes a prompt (with special tokens),
        given `tokens`, the API's count of them; None where the engine should tokenize the text
        itself."""
        if prefix in self._heads:
            self._heads.move_to_end(prefix)
            head = self._heads[prefix]
            ids = None if head is None else head + self._encode(rest, add_special_tokens=False)
        else:
            head = self._encode(prefix, add_special_tokens=True)
            ids = self._encode(prefix + rest, add_special_tokens=True)
            fits = ids == head + self._encode(rest, add_special_tokens=False)
            self._heads[prefix] = head if fits else None
            while len(self._heads) > self.MAX_PREFIXES:
                self._heads.popitem(last=False)
        return ids if ids is not None and len(ids) == tokens else None
