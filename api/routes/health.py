"""Liveness and readiness."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from api.deps import ServicesDep

router = APIRouter(tags=["health"])


class Readiness(BaseModel):
    """Whether the API can serve, and the state of each service it needs."""

    status: Literal["ready", "unavailable"]
    checks: dict[str, str]


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up; touches nothing else, so it stays fast under any load."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "A service is down or behind."}},
)
async def readyz(services: ServicesDep) -> JSONResponse:
    """Ready when Redis and the database answer and the schema is current."""
    checks: dict[str, Any] = {}
    try:
        await services.redis.ping()
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = f"unreachable: {type(exc).__name__}"
    try:
        current = await run_in_threadpool(services.db.is_current)
        checks["database"] = "ok" if current else "migrations pending: run `inferq db upgrade`"
    except Exception as exc:
        checks["database"] = f"unreachable: {type(exc).__name__}"
    ready = all(value == "ok" for value in checks.values())
    return JSONResponse(
        {"status": "ready" if ready else "unavailable", "checks": checks},
        status_code=200 if ready else 503,
    )
