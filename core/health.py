"""Liveness and readiness of the worker and the scheduler, served beside their metrics.

Each of them serves Prometheus metrics on a port of its own; the same port answers
`GET /healthz` (the process's main loop still turns: 200, or 503 once it has not turned for
`stall_s`, a hung process for an orchestrator to restart) and `GET /readyz` (200 once it does
its work: a worker whose engine is loaded and which takes jobs, a scheduler whose last tick
reached Redis and the database; 503 before and while it drains). A Redis outage makes a
process unready, never dead: restarting it would not bring Redis back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


class Health:
    """What a process's `/healthz` and `/readyz` answer; its main loop reports to it."""

    def __init__(self, stall_s: float = 60.0) -> None:
        self.stall_s = stall_s
        self._beat = time.monotonic()
        self._ready = False
        self._lock = threading.Lock()

    def beat(self) -> None:
        """The main loop went round once (whether or not its work succeeded)."""
        with self._lock:
            self._beat = time.monotonic()

    def set_ready(self, ready: bool) -> None:
        with self._lock:
            self._ready = ready

    def live(self) -> bool:
        with self._lock:
            return time.monotonic() - self._beat < self.stall_s

    def ready(self) -> bool:
        with self._lock:
            return self._ready and time.monotonic() - self._beat < self.stall_s


def health_app(health: Health) -> WsgiApp:
    """A WSGI app: `/healthz` and `/readyz` from `health`, every other path the metrics."""
    metrics = make_wsgi_app()
    checks = {"/healthz": health.live, "/readyz": health.ready}

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        check = checks.get(environ.get("PATH_INFO", ""))
        if check is None:
            return metrics(environ, start_response)
        ok = check()
        body = b'{"status": "ok"}' if ok else b'{"status": "unavailable"}'
        status = "200 OK" if ok else "503 Service Unavailable"
        start_response(status, [("Content-Type", "application/json")])
        return [body]

    return app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes come every few seconds; they are not worth a log line each."""


def serve_health(port: int, health: Health, address: str = "0.0.0.0") -> None:
    """Serve `health_app` on `port` from a daemon thread (raises OSError if it is taken)."""
    server = make_server(address, port, health_app(health), _Server, _QuietHandler)
    threading.Thread(target=server.serve_forever, name="inferq-health", daemon=True).start()
