"""The OpenAPI document: each operation declares the errors it answers, in the one error shape.

Validation errors are 400 with `{"error": {...}}` (see `api.errors`), never FastAPI's default
422 body, so the 422 responses FastAPI adds on its own are taken out of the document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

_DESCRIPTIONS = {
    400: "Invalid request: a body, query or header that does not validate, or a job over its "
    "tier's limits or the model's context.",
    401: "Missing or invalid API key (one answer for all three).",
    404: "No such resource for this caller; another owner's resource looks the same.",
    409: "The resource's state forbids the request.",
    413: "The request body is over INFERQ_MAX_BODY_BYTES.",
    429: "Rate or quota exceeded, or the queue is full; see Retry-After.",
    500: "The job failed.",
    503: "A backing service (Redis, the database) is unavailable; retry shortly.",
    504: "The job ran out of time.",
}

ResponsesDoc = dict[int | str, dict[str, Any]]


class ErrorDetail(BaseModel):
    """What went wrong: a stable `code` to match on and a message for people."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(description="Error class, e.g. invalid_request_error.")
    code: str = Field(description="Stable machine-readable code, e.g. not_found.")
    message: str = Field(description="Human-readable explanation.")
    param: str | None = Field(default=None, description="The parameter at fault, if any.")


class ErrorResponse(BaseModel):
    """The body of every error response."""

    error: ErrorDetail


def error_responses(*codes: int) -> ResponsesDoc:
    """OpenAPI `responses` for the error statuses `codes`, each with the JSON error body."""
    return {code: {"model": ErrorResponse, "description": _DESCRIPTIONS[code]} for code in codes}


COMMON_ERRORS = error_responses(400, 401, 503)
"""What any authenticated operation may answer."""


def install_openapi(app: FastAPI) -> None:
    """Serve the app's document without FastAPI's undeclared-by-us 422 responses."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if not app.openapi_schema:
            _drop_validation_422(build())
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]


def _drop_validation_422(schema: dict[str, Any]) -> None:
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
