"""With INFERQ_CORS_ORIGINS unset (the default), the API answers no cross-origin request."""

from __future__ import annotations

import httpx

from tests.support import Stack


def test_the_default_stack_sends_no_cors_headers(stack: Stack) -> None:
    origin = "https://app.example.com"
    preflight = httpx.options(
        f"{stack.api_url}/v1/jobs",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=30,
    )
    assert preflight.status_code == 405  # no CORS layer: OPTIONS is just an unserved method
    with stack.client(stack.create_key()) as client:
        listed = client.get("/v1/jobs", headers={"Origin": origin})
    assert listed.status_code == 200
    for response in (preflight, listed):
        assert not [name for name in response.headers if name.startswith("access-control-")]
