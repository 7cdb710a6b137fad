"""A small HTTP client for the CLI's `submit`: submit, then wait with progress."""

from __future__ import annotations

import sys
import time
from typing import Any

import httpx

FINAL = {"succeeded", "failed", "cancelled", "timed_out"}


class ApiError(Exception):
    """The API answered with an error body."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        error = body.get("error", {})
        super().__init__(f"{status} {error.get('code', '')}: {error.get('message', body)}")
        self.status = status
        self.body = body


class InferqClient:
    """Talks to one inferq API with one key."""

    def __init__(self, base_url: str, api_key: str, timeout_s: float = 70.0) -> None:
        self.http = httpx.Client(
            base_url=base_url,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout_s,
        )

    def _check(self, response: httpx.Response) -> dict[str, Any]:
        body: dict[str, Any] = response.json()
        if response.status_code >= 400:
            raise ApiError(response.status_code, body)
        return body

    def submit(self, prompt: str, **params: Any) -> dict[str, Any]:
        """Queue a job."""
        return self._check(self.http.post("/v1/jobs", json={"prompt": prompt, **params}))

    def get(self, job_id: str, wait_s: float = 0) -> dict[str, Any]:
        """The job, long-polling up to `wait_s` for a final state."""
        return self._check(self.http.get(f"/v1/jobs/{job_id}", params={"wait": wait_s}))

    def wait(self, job_id: str, *, show_progress: bool = True) -> dict[str, Any]:
        """Block until the job is final, showing its state on stderr."""
        started = time.monotonic()
        while True:
            job = self.get(job_id, wait_s=1.0)
            if show_progress and sys.stderr.isatty():
                elapsed = time.monotonic() - started
                sys.stderr.write(f"\r{job['id']}  {job['status']:<10} {elapsed:6.1f}s")
                sys.stderr.flush()
            elif show_progress and job["status"] in FINAL:
                sys.stderr.write(f"{job['id']} {job['status']}\n")
            if job["status"] in FINAL:
                if show_progress and sys.stderr.isatty():
                    sys.stderr.write("\n")
                return job
