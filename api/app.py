"""The FastAPI application: `api.app:app` for uvicorn, `create_app` for tests."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from api import metrics
from api.errors import install_error_handlers
from api.limits import BodySizeLimit
from api.openai import batch_router, file_router
from api.openai import router as openai_router
from api.openapi import install_openapi
from api.routes import health, jobs, qa_batches, streams
from api.services import Services
from api.url_guard import NulFreeUrls
from core.heap import freeze_heap
from core.settings import Settings, get_settings
from core.tracing import init_tracing

CORS_REQUEST_HEADERS = [
    "Authorization",
    "X-API-Key",
    "Content-Type",
    "Accept",
    "Idempotency-Key",
    "Last-Event-ID",
    "Prefer",
]
"""Headers a browser may send cross-origin (with `INFERQ_CORS_ORIGINS`); keys travel in headers,
never cookies, so credentials stay off."""

CORS_RESPONSE_HEADERS = [
    "Location",
    "Idempotent-Replayed",
    "Retry-After",
    "Preference-Applied",
]


def create_app(settings: Settings | None = None) -> FastAPI:
    """An API instance on `settings` (default: from the environment)."""
    settings = settings or get_settings()
    init_tracing("inferq-api", settings.otlp_endpoint)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = Services.build(settings)
        services.submissions.start()
        app.state.services = services
        freeze_heap()  # what start-up made lives as long as the process (core.heap)
        try:
            yield
        finally:
            await services.close()

    app = FastAPI(
        title="inferq",
        version="0.1.0",
        summary="An asynchronous job queue for LLM inference.",
        lifespan=lifespan,
    )
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(NulFreeUrls)
    app.add_middleware(metrics.HttpMetrics)
    if settings.cors_origins:
        # Outermost, so preflights and the body limit's 413 carry the headers too.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=CORS_REQUEST_HEADERS,
            expose_headers=CORS_RESPONSE_HEADERS,
            max_age=600,
        )
    install_error_handlers(app)
    install_openapi(app)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(jobs.router)
    app.include_router(streams.router)
    app.include_router(openai_router.router)
    app.include_router(file_router.router)
    app.include_router(batch_router.router)
    app.include_router(qa_batches.router)
    logging.getLogger("inferq").setLevel(settings.log_level)
    return app


def __getattr__(name: str) -> FastAPI:
    # `uvicorn api.app:app` builds the app on first access, not at import.
    if name == "app":
        return create_app()
    raise AttributeError(name)
