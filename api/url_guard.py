"""URLs with a NUL character are refused before any route sees them."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import error_response, uses_openai_errors


class NulFreeUrls:
    """ASGI middleware answering 400 to a path or query string holding a NUL character.

    No id, filter or cursor of this API contains one, and PostgreSQL cannot even compare text
    with one: without this, `GET /v1/jobs/%00` was a 500 there and a 404 on SQLite.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and ("\x00" in scope["path"] or b"%00" in scope["query_string"]):
            response = error_response(
                400,
                "invalid_request_error",
                "invalid_request",
                "The URL contains a NUL character.",
                openai=uses_openai_errors(scope["path"]),
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
