"""The API's Prometheus side: `/metrics`, and a middleware counting requests per route template.

Labels use the route's template (`/v1/jobs/{job_id}`), never the raw path, so job ids never
become label values. With several uvicorn processes, set `PROMETHEUS_MULTIPROC_DIR` and each
scrape aggregates them all.
"""

from __future__ import annotations

import os
import time

from fastapi import APIRouter, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.admission import waiting_counts
from api.deps import ServicesDep
from core.metrics import HTTP_LATENCY, HTTP_REQUESTS, QUEUE_LENGTH

router = APIRouter(tags=["observability"])

UNMATCHED = "<unmatched>"


class HttpMetrics:
    """Counts requests and times responses, labelled by method, route template and status."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_timed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                HTTP_LATENCY.labels(scope["method"], _route(scope)).observe(
                    time.perf_counter() - started
                )
            await send(message)

        try:
            await self.app(scope, receive, send_timed)
        finally:
            HTTP_REQUESTS.labels(scope["method"], _route(scope), str(status)).inc()


def _route(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED


@router.get("/metrics", include_in_schema=False)
async def metrics(services: ServicesDep) -> Response:
    """Prometheus exposition; queue lengths (held jobs included) are read at scrape time."""
    settings = services.settings
    for lane, waiting in (await waiting_counts(services.redis, settings.lanes)).items():
        model = lane or settings.model_name  # the first model's lane also holds its adapters'
        for tier, count in waiting.items():
            QUEUE_LENGTH.labels(tier.value, model).set(count)
    registry = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
