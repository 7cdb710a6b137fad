"""The one place where errors become HTTP responses: `{"error": {type, code, message}}`.

On the OpenAI-compatible paths the body always has `param` too (null when no parameter is at
fault), which is the exact shape the openai SDK reads.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from core.errors import ClientError, ServiceUnavailable

log = logging.getLogger(__name__)

_HTTP_CODES = {
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
}


OPENAI_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/files", "/v1/batches"}
)
"""The OpenAI-compatible endpoints (and the paths under the last three), whose errors always
carry `param`."""

_OPENAI_PREFIXES = ("/v1/models/", "/v1/files/", "/v1/batches/")


def uses_openai_errors(path: str) -> bool:
    """Whether errors on `path` take OpenAI's exact shape: message, type, param, code all there."""
    return path in OPENAI_PATHS or path.startswith(_OPENAI_PREFIXES)


def error_body(
    error_type: str,
    code: str,
    message: str,
    param: str | None = None,
    *,
    openai: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """The JSON body of every error response; `openai`: `param` is present even when null."""
    error: dict[str, Any] = {"type": error_type, "code": code, "message": message}
    if param is not None or openai:
        error["param"] = param
    error.update(extra)
    return {"error": error}


def error_response(
    status: int,
    error_type: str,
    code: str,
    message: str,
    param: str | None = None,
    *,
    openai: bool = False,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    """A JSON error response; `headers` are sent too (e.g. the `Allow` of a 405)."""
    headers = dict(headers or {})
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if "retry_after" in extra:
        headers["Retry-After"] = str(extra["retry_after"])
    body = error_body(error_type, code, message, param, openai=openai, **extra)
    return JSONResponse(body, status, headers=headers)


def describe_validation_error(error: dict[str, Any]) -> tuple[str, str]:
    """The parameter a pydantic error is about, and a message naming it."""
    loc = [str(part) for part in error.get("loc", ()) if part not in ("body", "query", "path")]
    param = ".".join(loc) or "body"
    if error.get("type") == "extra_forbidden":
        return param, f"Unknown field '{param}'."
    if error.get("type") == "json_invalid":
        return "body", "The body is not valid JSON."
    if param == "body" and error.get("type") in ("model_attributes_type", "dict_type"):
        return "body", "The body must be a JSON object (Content-Type: application/json)."
    return param, f"{param}: {error.get('msg', 'invalid value')}."


def allowed_methods(request: Request) -> list[str]:
    """The methods of the path template the request's path resolves to (its first match)."""
    matching = [
        route
        for route in request.app.router.routes
        if isinstance(route, Route) and route.matches(request.scope)[0] is not Match.NONE
    ]
    # `/v1/jobs/batch` would also fit `/v1/jobs/{job_id}`; only the first template counts.
    template = matching[0].path if matching else None
    return sorted({m for route in matching if route.path == template for m in route.methods or ()})


def install_error_handlers(app: FastAPI) -> None:
    """Map every error type to its response, once."""

    def openai(request: Request) -> bool:
        return uses_openai_errors(request.url.path)

    @app.exception_handler(ClientError)
    async def _client_error(request: Request, exc: ClientError) -> JSONResponse:
        return error_response(
            exc.status_code,
            exc.error_type,
            exc.code,
            exc.message,
            exc.param,
            openai=openai(request),
            **exc.extra,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        param, message = (
            describe_validation_error(errors[0]) if errors else ("body", "Invalid request.")
        )
        return error_response(
            400, "invalid_request_error", "invalid_request", message, param, openai=openai(request)
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type, code = _HTTP_CODES.get(exc.status_code, ("invalid_request_error", "http_error"))
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # RFC 9110: a 405 lists every method of the path, not just those of one route.
            headers["Allow"] = ", ".join(allowed_methods(request))
        return error_response(
            exc.status_code,
            error_type,
            code,
            str(exc.detail),
            openai=openai(request),
            headers=headers,
        )

    async def _unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.warning("backing service unavailable: %s", exc)
        return error_response(
            503,
            ServiceUnavailable.error_type,
            ServiceUnavailable.code,
            "A backing service is unavailable; retry shortly.",
            openai=openai(request),
        )

    app.add_exception_handler(ServiceUnavailable, _unavailable)
    app.add_exception_handler(redis.ConnectionError, _unavailable)
    app.add_exception_handler(redis.TimeoutError, _unavailable)
    app.add_exception_handler(OperationalError, _unavailable)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(
            500, "server_error", "internal_error", "Internal server error.", openai=openai(request)
        )
