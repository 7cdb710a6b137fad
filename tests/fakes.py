"""A fake engine for tests of the worker's own logic (merging, the runner's callbacks).

It stands in for vLLM only where the test is about what inferq does around the engine; every
test of generation itself runs the real engine.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from core.states import JobStatus
from workers.generation import Delta, GenerationRequest, GenerationResult
from workers.merging import MergingEngine


class StepEngine:
    """Records requests; the test makes their text and ends them."""

    def __init__(self, merging: MergingEngine) -> None:
        self.merging = merging
        self.requests: dict[str, GenerationRequest] = {}
        self.futures: dict[str, Future[GenerationResult]] = {}
        self.cancelled: list[str] = []
        self.text: dict[str, str] = {}
        self.refused: set[str] = set()

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        if request.job_id in self.refused:
            raise RuntimeError(f"the engine refuses {request.job_id}")
        self.requests[request.request_id] = request
        self.futures[request.request_id] = Future()
        self.text[request.request_id] = ""
        return self.futures[request.request_id]

    def step(self, request_id: str, text: str) -> None:
        request = self.requests[request_id]
        self.text[request_id] += text
        self.merging.on_deltas([Delta(request.job_id, request.attempt, text, 1, time.time())])

    def finish(self, request_id: str) -> None:
        text = self.text[request_id]
        self.futures[request_id].set_result(
            GenerationResult(
                status=JobStatus.SUCCEEDED,
                text=text,
                finish_reason="length",
                prompt_tokens=5,
                completion_tokens=len(text),
            )
        )

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return True

    def shutdown(self) -> None:
        pass
