"""The worker's list of running jobs, changed from the starter, callbacks and the heartbeat."""

from __future__ import annotations

import threading

from workers.running import RunningJobs


def test_an_earlier_attempt_ending_keeps_the_later_attempt_listed() -> None:
    running = RunningJobs()
    running.add("job_1", "job_1-1")
    running.add("job_1", "job_1-2")  # redelivered and started again here
    running.end("job_1", "job_1-1")
    assert running.request_of("job_1") == "job_1-2"
    running.end("job_1", "job_1-2")
    assert running.request_of("job_1") is None
    assert running.job_ids() == []


def test_threads_adding_and_ending_leave_nothing_behind() -> None:
    running = RunningJobs()

    def churn(worker: int) -> None:
        for n in range(2000):
            job_id = f"job_{worker}_{n}"
            running.add(job_id, f"{job_id}-1")
            running.job_ids()
            running.end(job_id, f"{job_id}-1")

    threads = [threading.Thread(target=churn, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert running.job_ids() == []
