"""The runner when a step fails: every job it was handed still ends once, none is left claimed
by a lease nobody holds, and none outlives its event stream.

Real Redis and SQLite; the engine is a fake the test drives (these are the runner's own
callbacks and leases, not generation).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from core import keys
from core.db import Database
from core.jobs import JobStore
from core.new_jobs import NewJob
from core.settings import Settings
from core.states import JobStatus
from migrations import upgrade
from tests.fakes import StepEngine
from workers.merging import MergingEngine
from workers.runner import JobRunner
from workers.starting import Started


@dataclass
class Parts:
    runner: JobRunner
    engine: StepEngine
    store: JobStore
    redis: redis.Redis

    def queued_job(self, prompt: str) -> str:
        new = NewJob(
            owner="faults",
            tier="premium",
            prompt=prompt,
            sampling_params={"max_tokens": 4},
            timeout_s=60,
            prompt_tokens=3,
        )
        job, _ = self.store.create(new)
        return job.id


@pytest.fixture
def parts(redis_url: str, tmp_path: Path) -> Iterator[Parts]:
    url = f"sqlite:///{tmp_path / 'runner.db'}"
    upgrade(url)
    settings = Settings(redis_url=redis_url, database_url=url)
    client = redis.Redis.from_url(redis_url)
    merging = MergingEngine(None)
    engine = StepEngine(merging)
    merging.attach(engine)
    store = JobStore(Database(url))
    runner = JobRunner(
        settings=settings,
        store=store,
        engine=merging,
        redis_client=client,
        worker_name="faults@inferq-test",
        claim_token="faults-process",
    )
    yield Parts(runner, engine, store, client)
    client.close()


def _wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_step_that_raises_ends_the_job_instead_of_stranding_it(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A callback that raises would be dropped by concurrent.futures: the job's message never
    acknowledged, and a warm shutdown's drain waiting for good."""
    job_id = parts.queued_job("Record me.")

    def broken_recorder(*_: object) -> None:
        raise RuntimeError("the recorder is gone")

    monkeypatch.setattr(parts.runner.outcomes, "record_async", broken_recorder)
    ends: list[JobStatus | None] = []
    parts.runner.submit(job_id, ends.append)
    _wait_for(lambda: f"{job_id}-1" in parts.engine.requests, "the job never reached the engine")
    parts.engine.step(f"{job_id}-1", "Done")
    parts.engine.finish(f"{job_id}-1")
    assert parts.runner.drain(timeout_s=30), "the job never ended"
    assert ends == [None]  # its lease lapses, and the reaper hands it on
    assert parts.runner._running.request_of(job_id) is None


def test_a_job_the_engine_refuses_goes_back_while_the_rest_of_its_batch_runs(
    parts: Parts,
) -> None:
    first, refused, last = (parts.queued_job(f"Batch {i}.") for i in range(3))
    parts.engine.refused.add(refused)
    answers = parts.runner.starter.start_batch([first, refused, last])
    assert isinstance(answers[first], Started) and isinstance(answers[last], Started)
    assert refused not in answers  # skipped: its message is acknowledged
    assert set(parts.runner._running.job_ids()) == {first, last}
    # Running in the database with no lease: the reaper requeues it as a lost attempt.
    assert parts.redis.get(keys.job_lease(refused)) is None
    stored = parts.store.get(refused)
    assert stored is not None and stored.status == JobStatus.RUNNING.value


def test_a_claim_whose_reply_was_lost_is_claimed_again(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis set the lease, the reply never came: the retry must not take this worker's own
    lease for a live worker's and skip the job (it would stay queued with no message)."""
    job_id = parts.queued_job("Claim me.")
    claim = parts.runner.leases.claim

    def claim_then_lose_the_reply(*args: Any, **kwargs: Any) -> Any:
        claim(*args, **kwargs)
        raise redis.ConnectionError("connection lost before the reply")

    monkeypatch.setattr(parts.runner.leases, "claim", claim_then_lose_the_reply)
    with pytest.raises(redis.ConnectionError):
        parts.runner.starter.start_batch([job_id])
    monkeypatch.undo()
    assert parts.redis.get(keys.job_lease(job_id)) is not None  # Redis did set it
    answers = parts.runner.starter.start_batch([job_id])
    assert isinstance(answers.get(job_id), Started), answers
    stored = parts.store.get(job_id)
    assert stored is not None and (stored.status, stored.attempt) == ("running", 1)


def test_a_lease_whose_claim_reply_was_lost_is_released_by_the_next_heartbeat(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until the lease this worker set without knowing it goes, another worker handed the job
    skips it: the heartbeat frees it, rather than the lease lapsing or the job coming back here."""
    job_id = parts.queued_job("Claim me, then go elsewhere.")
    claim = parts.runner.leases.claim

    def claim_then_lose_the_reply(*args: Any, **kwargs: Any) -> Any:
        claim(*args, **kwargs)
        raise redis.ConnectionError("connection lost before the reply")

    monkeypatch.setattr(parts.runner.leases, "claim", claim_then_lose_the_reply)
    with pytest.raises(redis.ConnectionError):
        parts.runner.starter.start_batch([job_id])
    monkeypatch.undo()

    other_worker = {job_id: "other@inferq-test:1"}
    held = parts.runner.leases.claimed([job_id], claim(other_worker, parts.redis))
    assert held == {}, "the lost claim's lease is still set, so another worker skips the job"

    parts.runner.renew_leases()

    assert len(parts.runner._stale_leases) == 0
    taken = parts.runner.leases.claimed([job_id], claim(other_worker, parts.redis))
    assert taken == {job_id: False}
    assert parts.redis.get(keys.job_lease(job_id)) == b"other@inferq-test:1"


def test_a_heartbeat_that_fails_keeps_the_leases_to_release(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stale lease whose release the heartbeat could not send is released by the next one."""
    job_id = parts.queued_job("Release me later.")
    token = "faults@inferq-test:stale"
    parts.redis.set(keys.job_lease(job_id), token, px=60_000)
    parts.runner._stale_leases.add(job_id, [token])

    def broken_pipeline(*_: Any, **__: Any) -> Any:
        raise redis.ConnectionError("Redis is out")

    monkeypatch.setattr(parts.runner.redis, "pipeline", broken_pipeline)
    with pytest.raises(redis.ConnectionError):
        parts.runner.renew_leases()
    monkeypatch.undo()
    assert len(parts.runner._stale_leases) == 1

    parts.runner.renew_leases()
    assert len(parts.runner._stale_leases) == 0
    assert parts.redis.get(keys.job_lease(job_id)) is None


def test_the_heartbeat_keeps_a_running_jobs_stream_through_a_run_longer_than_its_ttl(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deltas leave their stream's TTL as it is (`core.events`), so a run longer than the TTL
    keeps its stream only because the heartbeat restarts it, every third of the TTL."""
    job_id = parts.queued_job("Run for a long time.")
    answers = parts.runner.starter.start_batch([job_id])
    assert isinstance(answers[job_id], Started)
    stream = keys.job_event_stream(job_id)
    assert parts.redis.exists(stream)  # its running event
    parts.redis.expire(stream, 5)  # as if the run had lasted all but 5 s of the TTL
    parts.runner.renew_leases()  # a heartbeat soon after the start leaves it
    assert parts.redis.ttl(stream) <= 5
    third = parts.runner.settings.job_key_ttl_s / 3
    later = time.monotonic() + third
    monkeypatch.setattr("workers.runner.time.monotonic", lambda: later)
    parts.runner.renew_leases()
    assert parts.redis.ttl(stream) > 5


def test_the_heartbeat_renews_running_jobs_leases_every_third_of_their_ttl(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not every second: a lease is the backstop behind the worker's name claim, and renewing
    each running job's every second cost Redis more commands than the job's own work."""
    job_id = parts.queued_job("Hold me.")
    assert isinstance(parts.runner.starter.start_batch([job_id])[job_id], Started)
    lease = keys.job_lease(job_id)
    parts.redis.pexpire(lease, 5_000)
    parts.runner.renew_leases()  # a heartbeat soon after the start leaves it
    assert parts.redis.pttl(lease) <= 5_000
    later = time.monotonic() + parts.runner.settings.lease_ttl_s / 3
    monkeypatch.setattr("workers.runner.time.monotonic", lambda: later)
    parts.runner.renew_leases()
    assert parts.redis.pttl(lease) > 5_000
