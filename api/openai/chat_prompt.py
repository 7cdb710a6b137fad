"""Turning chat messages into the one prompt string a job carries.

A model whose tokenizer has a chat template gets its messages rendered with it, the way
Hugging Face tokenizers render them (a sandboxed Jinja environment, `add_generation_prompt`),
but with Jinja alone: the API host needs neither transformers nor torch. A model without one
(the small local model) gets the fallback: one `Role: content` line per message, then
`Assistant:` for the model to continue.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.environment import Template
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment

from core.errors import InvalidRequest
from core.modelinfo import ModelInfo

log = logging.getLogger(__name__)

FALLBACK_ROLES = {
    "system": "System",
    "developer": "System",
    "user": "User",
    "assistant": "Assistant",
}
"""The fallback's name for each role a message may have."""


def render_fallback(messages: list[dict[str, str]]) -> str:
    """One `Role: content` line per message, then `Assistant:` to be continued."""
    lines = [f"{FALLBACK_ROLES[m['role']]}: {m['content']}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


class _GenerationTag(Extension):
    """`{% generation %}…{% endgeneration %}` (training templates mark replies with it): a no-op."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Macro) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Hugging Face's tojson: not HTML-escaped, unlike Jinja's own.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=4)
def compile_template(source: str) -> Template | None:
    """The compiled chat template; None (and one warning) when it does not compile."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError:
        log.warning("the model's chat template does not compile; using the fallback", exc_info=True)
        return None


def _adds_bos_itself(model: ModelInfo, bos: str) -> bool:
    bos_id = model.tokenizer.token_to_id(bos)
    ids = model.tokenizer.encode("x", add_special_tokens=True).ids
    return bos_id is not None and bool(ids) and ids[0] == bos_id


def render_chat(model: ModelInfo, messages: list[dict[str, str]]) -> str:
    """The prompt for `messages`: the model's chat template if it has one, else the fallback.

    A template that opens with the BOS token loses it when the tokenizer adds BOS itself (the
    engine tokenizes job prompts with special tokens), so the prompt never starts with two.
    A template that refuses the messages (`raise_exception`) is a 400 naming `messages`.
    """
    template = compile_template(model.chat_template) if model.chat_template else None
    if template is None:
        return render_fallback(messages)
    special = model.special_tokens or {}
    try:
        prompt = template.render(messages=messages, add_generation_prompt=True, **special)
    except TemplateError as exc:
        raise InvalidRequest(
            f"The model's chat template rejected these messages: {exc}", param="messages"
        ) from exc
    bos = special.get("bos_token")
    if bos and prompt.startswith(bos) and _adds_bos_itself(model, bos):
        prompt = prompt[len(bos) :]
    return prompt
