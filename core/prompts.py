"""Prompts that share their beginning: stored once, tokenized once.

A batch's prompts often begin with the same long text: a Q&A batch's document, a long system
prompt. Such a batch stores that text once, as a `PromptPrefix` named by its SHA-256, and each
job keeps only the rest (`jobs.prompt_prefix_id`, then `jobs.prompt`); whoever runs a job puts
the two together again (`StoredPrefixes`, which caches them: a name never changes its text).

Counting a batch's tokens tokenizes the shared text once and each rest on its own. The sum is
the whole prompt's count only where no token spans the cut, so the cut is made a few tokens
before the shared text ends, at a token's start, and the sum is checked against a whole count
on the batch's first and last prompts; where it differs, every prompt is counted whole.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from sqlalchemy import select

from core.db import Database
from core.modelinfo import ModelInfo
from core.models import Job, PromptPrefix

MIN_SHARED_CHARS = 1024
"""A batch stores a prefix only when its prompts share at least this many characters."""
CUT_MARGIN_TOKENS = 8
"""How many of the shared text's last tokens go to each job's rest, so no token spans the cut."""


def text_digest(text: str) -> str:
    """The SHA-256 of `text` (UTF-8, lone surrogates kept), in hex: a prefix's name, and what
    the result cache names a prompt by."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class SharedPrefix:
    """The stored beginning of some jobs' prompts, and its token count."""

    id: str
    text: str
    tokens: int

    def row(self) -> dict[str, object]:
        """Its `prompt_prefixes` row, without the creation time."""
        return {"id": self.id, "text": self.text, "tokens": self.tokens}


@dataclass(frozen=True)
class CountedPrompts:
    """A batch's prompts as stored: an optional shared prefix, each job's rest, each whole count.

    Prompt `i` is `prefix.text + rests[i]` (just `rests[i]` without a prefix).
    """

    prefix: SharedPrefix | None
    rests: list[str]
    tokens: list[int]


def whole_digests(counted: CountedPrompts) -> list[Callable[[], str]]:
    """For each prompt, a function that gives its `text_digest` (the prefix hashed once)."""
    if counted.prefix is None:
        return [partial(text_digest, rest) for rest in counted.rests]
    head = hashlib.sha256(counted.prefix.text.encode("utf-8", "surrogatepass"))

    def after_head(rest: str) -> str:
        digest = head.copy()
        digest.update(rest.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()

    return [partial(after_head, rest) for rest in counted.rests]


def count_prompts(model: ModelInfo, prompts: Sequence[str]) -> CountedPrompts:
    """Count a batch's prompts, sharing the text they all begin with if it is long enough."""
    if len(prompts) >= 2:
        shared = _common_prefix(min(prompts), max(prompts))
        if len(shared) >= MIN_SHARED_CHARS:
            return count_with_head(model, shared, [prompt[len(shared) :] for prompt in prompts])
    return CountedPrompts(None, list(prompts), _count_each(model, prompts))


def count_with_head(model: ModelInfo, head: str, tails: Sequence[str]) -> CountedPrompts:
    """Count the prompts `head + tails[i]`, storing most of `head` once (see the module)."""
    encoding = model.tokenizer.encode(head, add_special_tokens=True)
    cut_token = len(encoding.ids) - CUT_MARGIN_TOKENS
    cut = encoding.offsets[cut_token][0] if cut_token > 0 else 0
    if len(tails) < 2 or cut < MIN_SHARED_CHARS:
        prompts = [head + tail for tail in tails]
        return CountedPrompts(None, prompts, _count_each(model, prompts))
    prefix = SharedPrefix(text_digest(head[:cut]), head[:cut], cut_token)
    rests = [head[cut:] + tail for tail in tails]
    tokens = [cut_token + n for n in _count_each(model, rests, special=False)]
    for index in {0, len(rests) - 1}:
        if model.count_tokens(prefix.text + rests[index]) != tokens[index]:
            whole = [prefix.text + rest for rest in rests]
            return CountedPrompts(prefix, rests, _count_each(model, whole))
    return CountedPrompts(prefix, rests, tokens)


def _common_prefix(first: str, second: str) -> str:
    low, high = 0, min(len(first), len(second))
    while low < high:  # a binary search on slice comparisons, which run in C
        middle = (low + high + 1) // 2
        if first[:middle] == second[:middle]:
            low = middle
        else:
            high = middle - 1
    return first[:low]


def _count_each(model: ModelInfo, texts: Sequence[str], special: bool = True) -> list[int]:
    encodings = model.tokenizer.encode_batch(list(texts), add_special_tokens=special)
    return [len(encoding.ids) for encoding in encodings]


class StoredPrefixes:
    """Stored prefixes as a worker reads them: each read once per process (a prefix's name fixes
    its text), with its token count."""

    MAX_ENTRIES = 256

    def __init__(self, db: Database) -> None:
        self.db = db
        self._read: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._lock = threading.Lock()

    def prompts(self, jobs: Sequence[Job]) -> dict[str, str]:
        """Each job's whole prompt, by job id."""
        wanted = {job.prompt_prefix_id for job in jobs if job.prompt_prefix_id is not None}
        read = self._read_all(wanted)
        return {
            job.id: read[job.prompt_prefix_id][0] + job.prompt
            if job.prompt_prefix_id
            else job.prompt
            for job in jobs
        }

    def text(self, job: Job) -> str:
        """The text of the job's prefix ('' without one; read by `prompts` already)."""
        if job.prompt_prefix_id is None:
            return ""
        with self._lock:
            entry = self._read.get(job.prompt_prefix_id)
        return "" if entry is None else entry[0]

    def shared(self, job: Job) -> tuple[str, int] | None:
        """The job's prefix and its tokens, if it has one (read by `prompts` already)."""
        if job.prompt_prefix_id is None:
            return None
        with self._lock:
            entry = self._read.get(job.prompt_prefix_id)
        return None if entry is None else (job.prompt_prefix_id, entry[1])

    def _read_all(self, ids: set[str]) -> dict[str, tuple[str, int]]:
        with self._lock:
            found = {i: self._read[i] for i in ids if i in self._read}
            for i in found:
                self._read.move_to_end(i)
        missing = ids - found.keys()
        if missing:
            with self.db.session() as session:
                rows = session.execute(
                    select(PromptPrefix.id, PromptPrefix.text, PromptPrefix.tokens).where(
                        PromptPrefix.id.in_(missing)
                    )
                )
                read = {row.id: (row.text, row.tokens) for row in rows}
            found.update(read)
            with self._lock:
                self._read.update(read)
                while len(self._read) > self.MAX_ENTRIES:
                    self._read.popitem(last=False)
        return found
