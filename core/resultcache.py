"""The result cache: a deterministic request's answer, kept in Redis for a while.

A request is deterministic when it samples greedily (temperature 0) or with a fixed seed; the
same model, prompt and sampling parameters then give the same text. Workers store such a job's
result when it succeeds; the API answers a repeat of it from here without the engine. The same
key names identical requests a worker merges into one engine request.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any


def is_deterministic(sampling: dict[str, Any]) -> bool:
    """Whether the sampling parameters make the output a function of the prompt."""
    return sampling.get("temperature", 1.0) == 0 or sampling.get("seed") is not None


def request_key(model: str, prompt_digest: str, sampling: dict[str, Any]) -> str | None:
    """A digest naming the request's result, or None if the request is not deterministic.

    `prompt_digest` is the prompt's `core.prompts.text_digest`: a batch that stores a shared
    prefix hashes it once and each job's rest after it.
    """
    if not is_deterministic(sampling):
        return None
    canonical = json.dumps([model, prompt_digest, sampling], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class CachedResult:
    """What a repeat of the request is answered with."""

    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int

    def dumps(self) -> str:
        """The JSON stored under the request's cache key."""
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def loads(cls, raw: bytes | str) -> CachedResult:
        """Parse what `dumps` stored."""
        return cls(**json.loads(raw))
