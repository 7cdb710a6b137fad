"""The jobs running in this worker, each with its engine request."""

from __future__ import annotations

import threading


class RunningJobs:
    """The engine request of every job running in this worker, safe to change from any thread.

    The starter adds a job's request, a generation's callback removes it, and the heartbeat,
    cancels and watches read it, each on a thread of its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, str] = {}

    def add(self, job_id: str, request_id: str) -> None:
        """The job now runs as `request_id` (a later attempt replaces an earlier one)."""
        with self._lock:
            self._requests[job_id] = request_id

    def end(self, job_id: str, request_id: str) -> None:
        """`request_id` has ended; the job stays listed if a later attempt runs it now."""
        with self._lock:
            if self._requests.get(job_id) == request_id:
                del self._requests[job_id]

    def request_of(self, job_id: str) -> str | None:
        """The engine request the job runs as here, if it runs here."""
        with self._lock:
            return self._requests.get(job_id)

    def job_ids(self) -> list[str]:
        """The jobs running here now."""
        with self._lock:
            return list(self._requests)
