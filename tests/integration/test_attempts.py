"""A job's attempts on a real database: the attempt a worker read fences its start."""

from __future__ import annotations

from core.jobs import JobStore
from core.new_jobs import NewJob


def test_a_worker_that_stalled_after_reading_a_job_does_not_start_it_once_another_has(
    store: JobStore,
) -> None:
    """Its message was handed on while it stalled between reading the job and starting it
    (`core.queue.unstarted`): the next worker starts the job, and the stalled one's start,
    fenced by the attempt it read, changes nothing."""
    job, _ = store.create(
        NewJob(
            owner="probe",
            tier="premium",
            prompt="Run me once.",
            sampling_params={},
            timeout_s=60,
            prompt_tokens=3,
        )
    )
    read = job.attempt
    (started,) = store.start_attempts({job.id: read}, "next@inferq-test")
    assert (started.status, started.attempt) == ("running", read + 1)

    assert store.start_attempts({job.id: read}, "stalled@inferq-test") == []
    row = store.get(job.id)
    assert row is not None
    assert (row.status, row.worker, row.attempt) == ("running", "next@inferq-test", read + 1)
    # A worker that read the job as it is now (its lease lapsed, say) may start it again.
    (again,) = store.start_attempts({job.id: read + 1}, "stalled@inferq-test")
    assert (again.worker, again.attempt) == ("stalled@inferq-test", read + 2)
