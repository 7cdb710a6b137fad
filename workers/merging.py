"""Request merging: identical deterministic jobs in flight on a worker share one engine request.

Jobs with the same prompt and sampling parameters that sample greedily or with a fixed seed make
the same text, so the first one (the leader) goes to the engine and later ones join its group
while it runs. Every member gets the group's deltas on its own stream (a member that joins late
first gets the text made so far, as one delta) and the full result at the end.

Members leave on their own: cancelling one, or reaching its own deadline (a watcher thread
keeps every member's), ends that job with the text it was sent so far, and the engine request
goes on for the others. Only when the last member leaves is the engine request aborted. The
engine request's own timeout is the leader's deadline plus `MERGE_WINDOW_S`, and a job joins a
group only if its deadline falls before that, so the group never ends a member early.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from core.prompts import text_digest
from core.resultcache import request_key
from core.states import JobStatus
from workers.generation import Delta, DeltaSink, Engine, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)

MERGE_WINDOW_S = 10.0
"""How much later than the leader's a joining job's deadline may be."""


@dataclass
class _Member:
    request: GenerationRequest
    future: Future[GenerationResult]
    merged: bool
    joined_at: datetime


@dataclass
class _Group:
    """One engine request and the jobs it serves."""

    key: str
    leader: GenerationRequest
    deadline: float  # monotonic: when the engine request times out
    members: dict[str, _Member] = field(default_factory=dict)
    chunks: list[str] = field(default_factory=list)
    tokens: int = 0
    first_token_at: datetime | None = None


class MergingEngine:
    """An `Engine` that merges identical deterministic requests; see the module docstring."""

    def __init__(self, on_deltas: DeltaSink | None, *, enabled: bool = True) -> None:
        """Deltas go to `on_deltas`; the engine gets `self.on_deltas` as its sink, then `attach`."""
        self._sink = on_deltas
        self.enabled = enabled
        self._lock = threading.RLock()
        self._groups: dict[str, _Group] = {}  # merge key → the group new members join
        self._by_request: dict[str, _Group] = {}  # member request id → its group
        self._by_stream: dict[tuple[str, int], _Group] = {}  # leader (job, attempt) → group
        self.inner: Engine | None = None
        self._deadlines: list[tuple[float, str]] = []  # heap of (monotonic deadline, request id)
        self._deadline_added = threading.Condition(self._lock)
        threading.Thread(
            target=self._watch_deadlines, name="inferq-merge-deadlines", daemon=True
        ).start()

    def attach(self, engine: Engine) -> MergingEngine:
        """Run requests on `engine` (whose delta sink must be `self.on_deltas`)."""
        self.inner = engine
        return self

    @property
    def _engine(self) -> Engine:
        assert self.inner is not None, "attach an engine first"
        return self.inner

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        """Start generating (or join an identical request); resolves when this job ends."""
        return self.submit_merging(request)[0]

    def submit_merging(self, request: GenerationRequest) -> tuple[Future[GenerationResult], bool]:
        """Like `submit`; also says whether the request joined one already in the engine."""
        adapter = request.adapter.name if request.adapter is not None else ""
        key = (
            request_key(adapter, text_digest(request.prompt), request.sampling)
            if self.enabled
            else None
        )
        if key is None:  # not mergeable: straight to the engine
            return self._engine.submit(request), False
        future: Future[GenerationResult] = Future()
        deadline = time.monotonic() + request.timeout_s
        member = _Member(request, future, merged=False, joined_at=datetime.now(UTC))
        with self._lock:
            # The watcher sleeps until the earliest deadline: only a new earliest one wakes it
            # (jobs of one tier arrive in deadline order, so a burst of them wakes it once).
            if not self._deadlines or deadline < self._deadlines[0][0]:
                self._deadline_added.notify()
            heapq.heappush(self._deadlines, (deadline, request.request_id))
            group = self._groups.get(key)
            if group is not None and deadline <= group.deadline:
                member.merged = True
                self._join(group, member)
                return future, True
            group = _Group(key, request, deadline + MERGE_WINDOW_S)
            group.members[request.request_id] = member
            self._groups[key] = group
            self._by_request[request.request_id] = group
            self._by_stream[(request.job_id, request.attempt)] = group
            generation = self._engine.submit(
                replace(request, timeout_s=group.deadline - time.monotonic())
            )
        generation.add_done_callback(lambda done: self._finish(group, done))
        return future, False

    def _join(self, group: _Group, member: _Member) -> None:
        """Add a member to a running group (lock held) and send it the text made so far."""
        request = member.request
        group.members[request.request_id] = member
        self._by_request[request.request_id] = group
        if group.chunks and self._sink is not None:
            text = "".join(group.chunks)
            self._sink([Delta(request.job_id, request.attempt, text, group.tokens, time.time())])

    def _watch_deadlines(self) -> None:
        """End every member whose own deadline has passed (`timed_out`, with its text)."""
        while True:
            with self._lock:
                while not self._deadlines or self._deadlines[0][0] > time.monotonic():
                    wait_s = self._deadlines[0][0] - time.monotonic() if self._deadlines else None
                    self._deadline_added.wait(wait_s)
                _, request_id = heapq.heappop(self._deadlines)
            self._leave(request_id, JobStatus.TIMED_OUT)  # a no-op if it already ended

    def cancel(self, request_id: str) -> bool:
        """End one job now with the text it has; the engine request stops when none are left."""
        with self._lock:
            grouped = request_id in self._by_request
        if not grouped:
            return self._engine.cancel(request_id)
        return self._leave(request_id, JobStatus.CANCELLED)

    def _leave(self, request_id: str, status: JobStatus) -> bool:
        """End a member with the text the group made so far (what its stream was sent)."""
        with self._lock:
            group = self._by_request.pop(request_id, None)
            if group is None:
                return False
            member = group.members.pop(request_id)
            text, tokens = "".join(group.chunks), group.tokens
            if not group.members:  # nobody wants the rest: free the engine's slot
                if self._groups.get(group.key) is group:
                    del self._groups[group.key]
                self._engine.cancel(group.leader.request_id)
        result = GenerationResult(
            status=status,
            text=text,
            finish_reason="cancelled" if status is JobStatus.CANCELLED else "timeout",
            completion_tokens=tokens,
            first_token_at=_first_token_for(member, group.first_token_at),
            merged=member.merged,
        )
        if status is JobStatus.TIMED_OUT:
            result.error_code = "run_timeout"
            result.error_message = (
                f"The job ran past its deadline of {member.request.timeout_s:g} s."
            )
        member.future.set_result(result)
        return True

    def on_deltas(self, deltas: list[Delta]) -> None:
        """Copy each engine step's deltas to every member of their group, in order."""
        out: list[Delta] = []
        with self._lock:
            for delta in deltas:
                group = self._by_stream.get((delta.job_id, delta.attempt))
                if group is None:
                    out.append(delta)
                    continue
                group.chunks.append(delta.text)
                group.tokens += delta.tokens
                if group.first_token_at is None and delta.tokens:
                    group.first_token_at = datetime.fromtimestamp(delta.at, UTC)
                out.extend(
                    Delta(m.request.job_id, m.request.attempt, delta.text, delta.tokens, delta.at)
                    for m in group.members.values()
                )
            if out and self._sink is not None:
                self._sink(out)

    def _finish(self, group: _Group, done: Future[GenerationResult]) -> None:
        """The engine request ended: every member still in the group ends with its result."""
        with self._lock:
            if self._groups.get(group.key) is group:
                del self._groups[group.key]
            self._by_stream.pop((group.leader.job_id, group.leader.attempt), None)
            members = list(group.members.values())
            group.members.clear()
            for member in members:
                self._by_request.pop(member.request.request_id, None)
        for member in members:
            error = done.exception()
            if error is not None:
                member.future.set_exception(error)
                continue
            result = done.result()
            if member.merged:
                first = _first_token_for(member, result.first_token_at)
                result = replace(result, merged=True, first_token_at=first)
            member.future.set_result(result)

    def shutdown(self) -> None:
        """Shut the engine down (every member of a running group ends cancelled)."""
        self._engine.shutdown()


def _first_token_for(member: _Member, group_first: datetime | None) -> datetime | None:
    """A member's first token: the group's, or when it joined if that was later."""
    if group_first is None:
        return None
    return max(group_first, member.joined_at)
