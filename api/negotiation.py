"""MessagePack on the job and batch endpoints: request bodies and, by `Accept`, responses.

A client sends `Content-Type: application/x-msgpack` with a MessagePack body, and/or
`Accept: application/x-msgpack` to get MessagePack back. Validation is the same as for JSON
(the decoded body goes through the same models). Errors stay JSON (`application/json`), so a
client can always read them.

`MsgpackRoute` does both for a router: it decodes a MessagePack body before FastAPI reads it,
and records the client's preference for `NegotiatedResponse`, which renders the response as
MessagePack or JSON accordingly.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from typing import Any

import msgpack
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from core.errors import InvalidRequest

MSGPACK = "application/x-msgpack"
_MSGPACK_TYPES = frozenset({MSGPACK, "application/msgpack", "application/vnd.msgpack"})
_JSON_TYPES = frozenset({"application/json", "*/*", "application/*"})

_wants_msgpack: ContextVar[bool] = ContextVar("inferq_wants_msgpack", default=False)


def _media_type(value: str) -> str:
    return value.split(";", 1)[0].strip().lower()


def prefers_msgpack(accept: str | None) -> bool:
    """Whether an `Accept` header ranks MessagePack above JSON (ties go to MessagePack)."""
    if not accept:
        return False
    best_msgpack = best_json = -1.0
    for part in accept.split(","):
        media, _, params = part.partition(";")
        quality = 1.0
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        media = media.strip().lower()
        if media in _MSGPACK_TYPES:
            best_msgpack = max(best_msgpack, quality)
        elif media in _JSON_TYPES:
            best_json = max(best_json, quality)
    return best_msgpack > 0 and best_msgpack >= best_json


class NegotiatedResponse(JSONResponse):
    """JSON, or MessagePack when the request asked for it (see `MsgpackRoute`)."""

    def render(self, content: Any) -> bytes:
        """Encode `content` (JSON-compatible data) in the negotiated format."""
        if _wants_msgpack.get():
            self.media_type = MSGPACK
            packed: bytes = msgpack.packb(content, use_bin_type=True)
            return packed
        return super().render(content)


class MsgpackRoute(APIRoute):
    """A route that accepts MessagePack bodies and answers in MessagePack when asked."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """Wrap FastAPI's handler: decode the body first, and note the response format."""
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            if _media_type(request.headers.get("content-type", "")) in _MSGPACK_TYPES:
                request = await _as_json_request(request)
            token = _wants_msgpack.set(prefers_msgpack(request.headers.get("accept")))
            try:
                return await handler(request)
            finally:
                _wants_msgpack.reset(token)

        return route


async def _as_json_request(request: Request) -> Request:
    """The same request with its MessagePack body decoded, as if it had come as JSON."""
    body = await request.body()
    try:
        payload = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise InvalidRequest(f"The body is not valid MessagePack: {exc}.", param="body") from exc
    scope = dict(request.scope)
    scope["headers"] = [
        (name, b"application/json" if name == b"content-type" else value)
        for name, value in request.scope["headers"]
    ]
    decoded = Request(scope, request.receive)
    decoded._body = body
    decoded._json = payload
    return decoded
