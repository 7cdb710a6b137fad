"""A small HTTP client for the CLI's `submit`: submit and follow the job's events as they come."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx

FINAL = {"succeeded", "failed", "cancelled", "timed_out"}
FINAL_EVENTS = {"done", "error", "cancelled", "timed_out"}


class ApiError(Exception):
    """The API answered with an error body."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        error = body.get("error", {})
        super().__init__(f"{status} {error.get('code', '')}: {error.get('message', body)}")
        self.status = status
        self.body = body


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON events of a Server-Sent Events stream (comments and ids are skipped)."""
    data: list[str] = []
    for line in lines:
        if line.startswith("data:"):
            data.append(line[5:].lstrip())
        elif not line and data:
            yield json.loads("\n".join(data))
            data = []


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

    def submit_and_follow(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Queue a job and yield its events until the final one.

        The job is cancelled if the stream is dropped first (Ctrl-C cancels it).
        """
        with self.http.stream(
            "POST", "/v1/jobs", params={"stream": "true"}, json=body, timeout=None
        ) as response:
            if response.status_code >= 400:
                response.read()
                raise ApiError(response.status_code, response.json())
            for event in sse_events(response.iter_lines()):
                yield event
                if event["type"] in FINAL_EVENTS:
                    return

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
