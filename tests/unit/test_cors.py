"""CORS is closed unless INFERQ_CORS_ORIGINS names origins; then only those get the headers."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from core.settings import Settings

ALLOWED = "https://app.example.com"
OTHER = "https://evil.example.net"


def _preflight(client: TestClient, origin: str) -> dict[str, str]:
    response = client.options(
        "/v1/jobs",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    return dict(response.headers)


def test_no_cors_headers_by_default() -> None:
    client = TestClient(create_app(Settings()))  # no lifespan: CORS and routing need no services
    assert "access-control-allow-origin" not in _preflight(client, ALLOWED)
    simple = client.get("/healthz", headers={"Origin": ALLOWED})
    assert "access-control-allow-origin" not in simple.headers


def test_a_configured_origin_is_allowed_and_no_other() -> None:
    client = TestClient(create_app(Settings(cors_origins=[ALLOWED])))
    allowed = _preflight(client, ALLOWED)
    assert allowed["access-control-allow-origin"] == ALLOWED
    assert "POST" in allowed["access-control-allow-methods"]
    assert "authorization" in allowed["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in allowed
    assert "access-control-allow-origin" not in _preflight(client, OTHER)

    simple = client.get("/healthz", headers={"Origin": ALLOWED})
    assert simple.headers["access-control-allow-origin"] == ALLOWED
    assert "location" in simple.headers["access-control-expose-headers"].lower()
    other = client.get("/healthz", headers={"Origin": OTHER})
    assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize(
    "value",
    [f"{ALLOWED}, https://b.example.org/", f'["{ALLOWED}", "https://b.example.org"]'],
    ids=["comma-separated", "json-list"],
)
def test_origins_come_from_the_environment(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERQ_CORS_ORIGINS", value)
    assert Settings().cors_origins == [ALLOWED, "https://b.example.org"]


def test_origins_default_to_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFERQ_CORS_ORIGINS", raising=False)
    assert Settings().cors_origins == []
    monkeypatch.setenv("INFERQ_CORS_ORIGINS", "")
    assert Settings().cors_origins == []
