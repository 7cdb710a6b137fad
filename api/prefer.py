"""`Prefer: wait=N` (RFC 7240): hold a submission until its jobs are final, up to N seconds.

A client that wants the answer, not a receipt, submits and gets the finished job in the same
request, instead of a 202 and then a long poll: one request per job, not two. A job still
running when the wait ends is answered as it stands (202), and the client polls from there.
Preferences are hints: an unknown or malformed one is ignored, as the RFC asks, and a wait
longer than the API's longest is cut to it.
"""

from __future__ import annotations

from api.services import Services
from core.models import Job
from core.states import JobStatus

PREFERENCE_APPLIED = "Preference-Applied"


def wait_preference(header: str | None, longest_s: float) -> int | None:
    """Seconds to wait that a `Prefer` header asks for (at most `longest_s`), or None."""
    if not header:
        return None
    for preference in header.split(","):
        token, _, value = preference.split(";", 1)[0].partition("=")
        if token.strip().lower() != "wait":
            continue
        value = value.strip().strip('"')
        if value.isdigit():  # delta-seconds: digits only
            return min(int(value), int(longest_s))
    return None


async def final_or_current(services: Services, jobs: list[Job], timeout_s: float) -> list[Job]:
    """The jobs once every one is final, or as they stand after `timeout_s`, in the same order."""
    waiting = [job.id for job in jobs if not JobStatus(job.status).is_final]
    if not waiting or timeout_s <= 0:
        return jobs
    await services.finals.wait(waiting, timeout_s)
    current = await services.reads.get_many(waiting)
    return [current.get(job.id, job) for job in jobs]


async def honour_wait(
    services: Services, jobs: list[Job], prefer: str | None, longest_s: float
) -> tuple[list[Job], int | None, dict[str, str]]:
    """Under `Prefer: wait=N`: the jobs after the wait, 200 if all ended (else 202), and the
    `Preference-Applied` header. Without it: the jobs unchanged, no status, no header."""
    wait = wait_preference(prefer, longest_s)
    if wait is None:
        return jobs, None, {}
    jobs = await final_or_current(services, jobs, wait)
    ended = all(JobStatus(job.status).is_final for job in jobs)
    return jobs, 200 if ended else 202, {PREFERENCE_APPLIED: f"wait={wait}"}
