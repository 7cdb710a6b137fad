"""The worker's and the scheduler's `/healthz` and `/readyz`, served beside their metrics."""

from __future__ import annotations

import time

import httpx

from core.health import Health, serve_health
from inferq.local import free_port


def test_health_and_metrics_share_a_port() -> None:
    health = Health(stall_s=0.5)
    port = free_port()
    serve_health(port, health, address="127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=url, timeout=5) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 503  # not doing its work yet
        health.set_ready(True)
        assert client.get("/readyz").json() == {"status": "ok"}
        assert "python_info" in client.get("/metrics").text

        time.sleep(0.6)  # its loop stopped turning: a hung process
        assert client.get("/healthz").status_code == 503
        assert client.get("/readyz").status_code == 503
        health.beat()
        assert client.get("/healthz").status_code == 200
        health.set_ready(False)  # draining
        assert client.get("/readyz").status_code == 503
