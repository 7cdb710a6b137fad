"""No API key (right or wrong) and no Flower password ever reaches a process's log."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from core.tiers import Tier
from inferq.local import free_port
from tests.support import FLOWER_AUTH, Stack, read_sse, wait_final

FLOWER_USER, FLOWER_PASSWORD = FLOWER_AUTH.split(":", 1)


def _log_dir(stack: Stack) -> Path:
    return stack.local.settings.data_dir.resolve() / "logs"


@pytest.fixture
def flower_url(stack: Stack) -> Iterator[str]:
    """Flower on the stack's broker, with the stack's credentials, logging beside the others."""
    port = free_port()
    log = (_log_dir(stack) / "flower.log").open("ab")
    command = [sys.executable, "-m", "inferq", "flower", "--port", str(port)]
    process = subprocess.Popen(command, env=stack.local.env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "flower exited"
            try:
                if httpx.get(url, timeout=2).status_code == 401:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "flower did not start"
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def _client(stack: Stack, headers: dict[str, str]) -> httpx.Client:
    return httpx.Client(base_url=stack.api_url, headers=headers, timeout=60)


def _use_keys(stack: Stack, key: str, wrong_key: str) -> str:
    """Every way a key travels: Bearer and X-API-Key, HTTP, SSE and WebSocket; and a wrong one."""
    job = stack.submit(key, prompt="A job whose key must stay secret.", max_tokens=4)
    with stack.client(key) as client:
        wait_final(client, job["id"])
        assert read_sse(client, job["id"])[-1]["type"] == "done"
    with _client(stack, {"X-API-Key": key}) as client:
        assert client.get(f"/v1/jobs/{job['id']}").status_code == 200
        assert client.post("/v1/jobs", json={"prompt": 5}).status_code == 400
    for headers in (
        {"Authorization": f"Bearer {wrong_key}"},
        {"X-API-Key": wrong_key},
        {"Authorization": f"Basic {wrong_key}"},
    ):
        with _client(stack, headers) as client:
            assert client.get("/v1/jobs").status_code == 401
            assert client.post("/v1/jobs", json={"prompt": "x"}).status_code == 401
    url = stack.api_url.replace("http://", "ws://") + "/v1/ws"
    with connect(url, additional_headers={"X-API-Key": key}, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "subscribe", "ref": 1, "job_id": job["id"]}))
        assert json.loads(ws.recv(timeout=30))["type"] == "subscribed"
    with pytest.raises(InvalidStatus) as refused:
        connect(url, additional_headers={"Authorization": f"Bearer {wrong_key}"}).close()
    assert refused.value.response.status_code == 401
    return str(job["id"])


def test_keys_and_the_flower_password_never_reach_the_logs(stack: Stack, flower_url: str) -> None:
    key = stack.create_key(Tier.STANDARD)
    wrong_key = "iq_" + secrets.token_urlsafe(24)  # shaped like a real key
    job_id = _use_keys(stack, key, wrong_key)
    assert httpx.get(flower_url, auth=(FLOWER_USER, FLOWER_PASSWORD)).status_code == 200
    assert httpx.get(flower_url, auth=(FLOWER_USER, "not-" + FLOWER_PASSWORD)).status_code == 401
    # The logs that are read must be the live ones, holding what was logged about these requests.
    deadline = time.monotonic() + 30
    while job_id not in (_log_dir(stack) / "worker.log").read_text(errors="replace"):
        assert time.monotonic() < deadline, "the worker never logged the job"
        time.sleep(0.2)

    logs = {path.name: path.read_text(errors="replace") for path in _log_dir(stack).glob("*.log")}
    assert {"api.log", "worker.log", "scheduler.log", "flower.log"} <= set(logs)
    for name, text in logs.items():
        for secret in (key, wrong_key, FLOWER_PASSWORD):
            assert secret not in text, f"{name} contains a secret"
