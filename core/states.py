"""Job states and the transitions allowed between them."""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    """Where a job is in its life: queued → running → one final state."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def is_final(self) -> bool:
        """True for the states a job never leaves."""
        return self in FINAL_STATES


class ServedFrom(StrEnum):
    """Where a finished job's text came from."""

    ENGINE = "engine"
    """Its own engine request."""
    MERGED = "merged"
    """An identical request's engine run, shared while both were in flight."""
    CACHE = "cache"
    """The result cache: an identical request's earlier answer; no engine involved."""


FINAL_STATES: frozenset[JobStatus] = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.TIMED_OUT}
)

# RUNNING → RUNNING is a redelivery after a lost worker: the new attempt takes over.
ALLOWED_TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.RUNNING, JobStatus.CANCELLED, JobStatus.TIMED_OUT}),
    JobStatus.RUNNING: frozenset({JobStatus.RUNNING, *FINAL_STATES}),
    **{final: frozenset() for final in FINAL_STATES},
}


def can_transition(current: JobStatus, target: JobStatus) -> bool:
    """Whether a job in `current` may move to `target`."""
    return target in ALLOWED_TRANSITIONS[current]


def final_event_type(status: JobStatus) -> str:
    """The name of the last event on a job's stream for a final status."""
    return {
        JobStatus.SUCCEEDED: "done",
        JobStatus.FAILED: "error",
        JobStatus.CANCELLED: "cancelled",
        JobStatus.TIMED_OUT: "timed_out",
    }[status]
