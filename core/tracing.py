"""OpenTelemetry tracing from the API through the queue to the worker, when configured.

With `INFERQ_OTLP_ENDPOINT` set, each process exports its spans over OTLP/HTTP; the API's
submit span travels to the worker as W3C trace-context headers on the Celery message, so one
trace shows the request, the wait in the queue and the run. Unset, nothing is set up: spans
come from OpenTelemetry's no-op tracer and the headers are empty.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from opentelemetry import context, propagate, trace

log = logging.getLogger(__name__)

TRACER_NAME = "inferq"


def init_tracing(service_name: str, endpoint: str | None) -> bool:
    """Export this process's spans to `endpoint` (OTLP/HTTP); False if tracing stays off."""
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporter = OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces")
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing to %s as %s", endpoint, service_name)
    return True


def tracer() -> trace.Tracer:
    """inferq's tracer (a no-op one when tracing is off)."""
    return trace.get_tracer(TRACER_NAME)


def current_headers() -> dict[str, str]:
    """The current span's context as message headers (`traceparent`, …); empty when off."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def context_from(headers: Mapping[str, Any]) -> context.Context:
    """The context a message's headers carry (empty when they carry none)."""
    return propagate.extract({k: v for k, v in headers.items() if isinstance(v, str)})


def shutdown() -> None:
    """Flush spans still buffered (at process exit)."""
    provider = trace.get_tracer_provider()
    flush = getattr(provider, "shutdown", None)
    if flush is not None:
        flush()
