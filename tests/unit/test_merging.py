"""Request merging's bookkeeping, on a fake engine whose steps the test drives by hand."""

from __future__ import annotations

from typing import Any

from core.states import JobStatus
from tests.fakes import StepEngine
from workers.generation import Delta, GenerationRequest
from workers.merging import MergingEngine


def _setup() -> tuple[MergingEngine, StepEngine, list[Delta]]:
    sent: list[Delta] = []
    merging = MergingEngine(sent.extend)
    engine = StepEngine(merging)
    merging.attach(engine)
    return merging, engine, sent


def _request(job: str, timeout_s: float = 30, **sampling: Any) -> GenerationRequest:
    params = {"max_tokens": 8, "temperature": 0.0, **sampling}
    return GenerationRequest(f"{job}-1", "Same prompt.", params, 0, timeout_s, job, 1)


def _stream(sent: list[Delta], job: str) -> str:
    return "".join(delta.text for delta in sent if delta.job_id == job)


def test_identical_deterministic_requests_share_one_engine_request() -> None:
    merging, engine, sent = _setup()
    first, merged_first = merging.submit_merging(_request("a"))
    engine.step("a-1", "Hel")
    second, merged_second = merging.submit_merging(_request("b"))  # joins mid-run
    engine.step("a-1", "lo")
    engine.finish("a-1")

    assert (merged_first, merged_second) == (False, True)
    assert list(engine.requests) == ["a-1"]
    for job, future in (("a", first), ("b", second)):
        result = future.result(timeout=1)
        assert result.status is JobStatus.SUCCEEDED
        assert result.text == "Hello" == _stream(sent, job)
    assert not first.result().merged and second.result().merged


def test_random_sampling_is_never_merged() -> None:
    merging, engine, _ = _setup()
    merging.submit_merging(_request("a", temperature=0.8))
    _, merged = merging.submit_merging(_request("b", temperature=0.8))
    assert not merged
    assert list(engine.requests) == ["a-1", "b-1"]
    # A fixed seed makes it deterministic again.
    merging.submit_merging(_request("c", temperature=0.8, seed=7))
    _, merged = merging.submit_merging(_request("d", temperature=0.8, seed=7))
    assert merged


def test_cancelling_one_member_leaves_the_others_running() -> None:
    merging, engine, sent = _setup()
    first = merging.submit(_request("a"))
    second = merging.submit(_request("b"))
    engine.step("a-1", "Par")
    assert merging.cancel("a-1")
    cancelled = first.result(timeout=1)
    assert cancelled.status is JobStatus.CANCELLED and cancelled.text == "Par"
    assert engine.cancelled == []  # b still wants the text

    engine.step("a-1", "tial")
    engine.finish("a-1")
    assert second.result(timeout=1).text == "Partial" == _stream(sent, "b")
    assert _stream(sent, "a") == "Par"  # nothing after its cancel


def test_the_last_member_leaving_aborts_the_engine_request() -> None:
    merging, engine, _ = _setup()
    first = merging.submit(_request("a"))
    second = merging.submit(_request("b"))
    merging.cancel("b-1")
    merging.cancel("a-1")
    assert engine.cancelled == ["a-1"]
    assert first.result(timeout=1).status is JobStatus.CANCELLED
    assert second.result(timeout=1).status is JobStatus.CANCELLED


def test_a_member_times_out_at_its_own_deadline() -> None:
    merging, engine, _ = _setup()
    patient = merging.submit(_request("a", timeout_s=30))
    hasty = merging.submit(_request("b", timeout_s=0.2))
    engine.step("a-1", "Early")
    timed_out = hasty.result(timeout=5)
    assert timed_out.status is JobStatus.TIMED_OUT
    assert timed_out.text == "Early" and timed_out.error_code == "run_timeout"
    assert not patient.done() and engine.cancelled == []


def test_a_job_with_a_much_later_deadline_starts_its_own_request() -> None:
    merging, engine, _ = _setup()
    merging.submit(_request("a", timeout_s=5))
    _, merged = merging.submit_merging(_request("b", timeout_s=120))
    assert not merged
    assert list(engine.requests) == ["a-1", "b-1"]


def test_only_a_new_earliest_deadline_wakes_the_deadline_watcher() -> None:
    merging, _engine, _ = _setup()
    wakes: list[int] = []
    condition = merging._deadline_added
    notify = condition.notify

    def counted(n: int = 1) -> None:
        wakes.append(n)
        notify(n)

    condition.notify = counted  # type: ignore[method-assign]
    merging.submit(_request("first", timeout_s=30))
    for index in range(50):  # later deadlines: the watcher sleeps on
        merging.submit(_request(f"later{index}", timeout_s=31 + index, seed=index))
    assert len(wakes) == 1
    hasty = merging.submit(_request("hasty", timeout_s=0.2, seed=99))  # a new earliest
    assert len(wakes) == 2
    assert hasty.result(timeout=5).status is JobStatus.TIMED_OUT
