"""The SLA benchmark's drivers: a trace replayed open-loop on inferq and on vLLM's own server,
each request's outcome judged by one rule, and the closed-loop calibration of capacity.

The rule, the same for every system: a request sent at `sent` with its tier's limit `limit_s`
is *completed* if its last token came by `sent + limit_s`, *timed out* if not (or if the system
ended it for its deadline), *refused* if the answer was 429, and *failed* on any other error.
Time to first token counts from `sent`, the client's clock just before the request went out.

- vLLM's server: one streamed `POST /v1/completions` per request (with `priority` from its tier
  when the server schedules by priority). First token and end are when the client parsed the
  chunk carrying them; the token count is the chunk's running usage. At its deadline the client
  closes the stream, which makes vLLM abort the request.
- inferq: one `POST /v1/jobs` per request with the tier's key and `Prefer: wait`, then long
  polls until the job has ended. The job's own tier limit ends it (the stack runs with the
  benchmark's scaled limits); first token and end are read from the job's record (`created_at`
  plus `timings`, written on the same host's clock), not from a live stream: a stream per job
  would cost the 2-vCPU host's API and client more than the jobs themselves. The record's first
  token is when the worker had it, so inferq's TTFT leaves out the hop to a streaming reader
  (up to `INFERQ_STREAM_INTERVAL_MS` plus a Redis round trip), which vLLM's includes. A job not
  ended `OVERRUN_GRACE_S` past its deadline is cancelled by the client and counted as timed out
  and as an overrun.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import aiohttp
from report import percentile
from sla_trace import Trace, TraceRequest

FINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled", "timed_out"})
OVERRUN_GRACE_S = 5.0
"""How long past its deadline an inferq job may take to be ended by inferq itself."""
MAX_WAIT_S = 60
"""The API's longest wait (`Prefer: wait`, `?wait=`)."""
TEMPERATURE = 1.0
"""Sampled, not greedy: no two requests are identical, so neither server merges or caches."""


@dataclass
class Outcome:
    """What became of one request, on the client's wall clock (`time.time()`)."""

    tier: str
    sent: float
    limit_s: float
    status: str
    """completed, timed_out, refused or failed."""
    first_token: float | None = None
    end: float | None = None
    """When its last token came, or when it was ended for its deadline."""
    output_tokens: int = 0
    lag_s: float = 0.0
    """How late the client sent it against the trace's schedule."""
    overran: bool = False
    detail: str = ""

    @property
    def ttft_s(self) -> float | None:
        """Sent → first token; None if none came within the limit."""
        if self.first_token is None or self.first_token - self.sent > self.limit_s:
            return None
        return self.first_token - self.sent

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, for a completed request of 2+ tokens."""
        if self.status != "completed" or self.first_token is None or self.end is None:
            return None
        if self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    def tokens_between(self, start: float, stop: float) -> float:
        """Its output tokens made within [start, stop], taking them as made at an even pace
        from the first token to the end (the same estimate for every system)."""
        if not self.output_tokens or self.first_token is None or self.end is None:
            return 0.0
        if self.end <= self.first_token:
            return float(self.output_tokens) if start <= self.end <= stop else 0.0
        overlap = min(stop, self.end) - max(start, self.first_token)
        return self.output_tokens * max(0.0, overlap) / (self.end - self.first_token)

    def summary(self) -> dict[str, Any]:
        """The outcome as JSON-ready values, times relative to `sent`."""
        return {
            "tier": self.tier,
            "status": self.status,
            "ttft_s": _rounded(self.ttft_s),
            "end_s": _rounded(None if self.end is None else self.end - self.sent),
            "output_tokens": self.output_tokens,
            "lag_s": round(self.lag_s, 4),
            **({"overran": True} if self.overran else {}),
            **({"detail": self.detail} if self.detail else {}),
        }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


Sender = Callable[[TraceRequest, float], Coroutine[Any, Any, Outcome]]


async def replay(trace: Trace, send: Sender) -> tuple[float, list[Outcome]]:
    """Send every request of the trace at its time, whether or not earlier ones have been
    answered (open loop); wait until all have ended. Returns (start, outcomes)."""
    start = time.time()
    tasks: list[asyncio.Task[Outcome]] = []
    for request in trace.requests:
        delay = start + request.at_s - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = time.time() - (start + request.at_s)
        tasks.append(asyncio.create_task(send(request, lag)))
    return start, list(await asyncio.gather(*tasks))


def client_session(base_url: str) -> aiohttp.ClientSession:
    """A session with no connection limit and no total timeout: every request of an open-loop
    trace holds its own connection for as long as it runs, as independent clients would."""
    return aiohttp.ClientSession(
        base_url,
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
    )


async def error_detail(response: aiohttp.ClientResponse) -> str:
    """`HTTP <status> <code>` of an error answer (its OpenAI-shaped code, else its text's
    start): short, since thousands of refusals are saved with the results."""
    text = await response.text()
    try:
        error = json.loads(text).get("error") or {}
        code = error.get("code") or error.get("type") or text[:80]
    except (ValueError, AttributeError):
        code = text[:80]
    return f"HTTP {response.status} {code}"


class VllmSender:
    """Sends trace requests to vLLM's server as streamed completions, cancelled at deadline."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        model: str,
        limits: dict[str, float],
        priorities: dict[str, int] | None,
    ) -> None:
        self._session = session
        self._model = model
        self._limits = limits
        self._priorities = priorities

    def body(self, request: TraceRequest) -> dict[str, Any]:
        """The completion request, with the tier's priority if the server schedules by it."""
        body: dict[str, Any] = {
            "model": self._model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "ignore_eos": True,
            "temperature": TEMPERATURE,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if self._priorities is not None:
            body["priority"] = self._priorities[request.tier]
        return body

    async def __call__(self, request: TraceRequest, lag: float) -> Outcome:
        """One request, streamed until its end or its deadline."""
        limit = self._limits[request.tier]
        outcome = Outcome(request.tier, time.time(), limit, "timed_out", lag_s=lag)
        try:
            async with asyncio.timeout(limit):
                await self._stream(request, outcome)
        except TimeoutError:
            outcome.status, outcome.end = "timed_out", time.time()
        except aiohttp.ClientError as exc:
            outcome.status, outcome.end, outcome.detail = "failed", time.time(), repr(exc)
        return outcome

    async def _stream(self, request: TraceRequest, outcome: Outcome) -> None:
        async with self._session.post("/v1/completions", json=self.body(request)) as response:
            if response.status != 200:
                outcome.status = "refused" if response.status == 429 else "failed"
                outcome.detail = await error_detail(response)
                outcome.end = time.time()
                return
            finished = False
            try:
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage")
                    if usage and usage.get("completion_tokens"):
                        if outcome.first_token is None:
                            outcome.first_token = time.time()
                        outcome.output_tokens = usage["completion_tokens"]
                    if any(c.get("finish_reason") for c in chunk.get("choices", [])):
                        finished = True
            except BaseException:
                # Cut off at the deadline: drop the connection (never pool it half-read), so
                # the server sees the client go and aborts the request.
                response.close()
                raise
            outcome.end = time.time()
            outcome.status = "completed" if finished else "failed"
            if not finished:
                outcome.detail = "the stream ended without a finish reason"


class InferqSender:
    """Submits trace requests as inferq jobs with their tier's key and waits for their end."""

    def __init__(
        self, session: aiohttp.ClientSession, keys: dict[str, str], limits: dict[str, float]
    ) -> None:
        self._session = session
        self._keys = keys
        self._limits = limits

    def _headers(self, tier: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._keys[tier]}"}

    async def __call__(self, request: TraceRequest, lag: float) -> Outcome:
        """One job: submit, wait until it ends (cancel it if it overruns), judge its record."""
        limit = self._limits[request.tier]
        sent = time.time()
        body = {
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "ignore_eos": True,
            "temperature": TEMPERATURE,
        }
        wait_s = min(MAX_WAIT_S, math.ceil(limit + OVERRUN_GRACE_S))
        headers = {**self._headers(request.tier), "Prefer": f"wait={wait_s}"}
        try:
            async with self._session.post("/v1/jobs", json=body, headers=headers) as response:
                if response.status not in (200, 202):
                    status = "refused" if response.status == 429 else "failed"
                    detail = await error_detail(response)
                    return Outcome(
                        request.tier, sent, limit, status, end=time.time(), lag_s=lag, detail=detail
                    )
                job = await response.json()
            job, overran = await self._wait_end(job, request.tier, sent + limit + OVERRUN_GRACE_S)
        except aiohttp.ClientError as exc:
            detail = repr(exc)
            return Outcome(
                request.tier, sent, limit, "failed", end=time.time(), lag_s=lag, detail=detail
            )
        return judge_job(job, request.tier, sent, limit, lag, overran)

    async def _wait_end(
        self, job: dict[str, Any], tier: str, give_up: float
    ) -> tuple[dict[str, Any], bool]:
        """The job once ended; past `give_up` the client cancels it (an overrun)."""
        while job["status"] not in FINAL_STATUSES:
            left = give_up - time.time()
            if left <= 0:
                return await self._cancel(job, tier), True
            job = await self._get(job["id"], tier, min(MAX_WAIT_S, max(1, math.ceil(left))))
        return job, False

    async def _get(self, job_id: str, tier: str, wait_s: float) -> dict[str, Any]:
        params = {"wait": str(wait_s)} if wait_s else None
        async with self._session.get(
            f"/v1/jobs/{job_id}", params=params, headers=self._headers(tier)
        ) as response:
            response.raise_for_status()
            job: dict[str, Any] = await response.json()
        return job

    async def _cancel(self, job: dict[str, Any], tier: str) -> dict[str, Any]:
        """Cancel the job and return it once ended (or as it stands after a last wait)."""
        async with self._session.delete(
            f"/v1/jobs/{job['id']}", headers=self._headers(tier)
        ) as response:
            await response.read()
        return await self._get(job["id"], tier, 10)


def job_times(job: dict[str, Any]) -> tuple[float | None, float | None]:
    """(first token, end) of an inferq job record, as wall-clock seconds."""
    created = datetime.fromisoformat(job["created_at"]).timestamp()
    timings = job["timings"]
    first = None if timings["ttft_s"] is None else created + timings["ttft_s"]
    end = None if timings["total_s"] is None else created + timings["total_s"]
    return first, end


def job_tokens(job: dict[str, Any]) -> int:
    """Output tokens an inferq job made (those of a job ended early included)."""
    return int(job["usage"]["completion_tokens"] or 0)


def judge_job(
    job: dict[str, Any], tier: str, sent: float, limit: float, lag: float, overran: bool
) -> Outcome:
    """The outcome of an inferq job by the benchmark's rule (see the module's docstring)."""
    first, end = job_times(job)
    if job["status"] == "succeeded" and end is not None and end <= sent + limit:
        status = "completed"
    elif job["status"] in ("succeeded", "timed_out") or overran:
        status = "timed_out"
    else:
        status = "failed"
    error = job.get("error") or {}
    return Outcome(
        tier,
        sent,
        limit,
        status,
        first_token=first,
        end=end if end is not None else time.time(),
        output_tokens=job_tokens(job),
        lag_s=lag,
        overran=overran,
        detail="" if status == "completed" else f"{job['status']}: {error.get('code', '')}",
    )


async def inferq_job(
    session: aiohttp.ClientSession, key: str, request: TraceRequest, wait_s: int = MAX_WAIT_S
) -> dict[str, Any]:
    """Submit one job and return its record once ended (no deadline of the client's)."""
    headers = {"Authorization": f"Bearer {key}"}
    body = {
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "ignore_eos": True,
        "temperature": TEMPERATURE,
    }
    while True:
        async with session.post(
            "/v1/jobs", json=body, headers={**headers, "Prefer": f"wait={wait_s}"}
        ) as response:
            if response.status == 429:  # admission control: wait as it asks, then retry
                await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
                continue
            if response.status not in (200, 202):
                raise RuntimeError(f"POST /v1/jobs answered {response.status}")
            job: dict[str, Any] = await response.json()
            break
    while job["status"] not in FINAL_STATUSES:
        async with session.get(
            f"/v1/jobs/{job['id']}", params={"wait": str(wait_s)}, headers=headers
        ) as response:
            response.raise_for_status()
            job = await response.json()
    return job


@dataclass
class Calibration:
    """Capacity from a closed-loop run: output tokens/s while saturated, and jobs/s."""

    clients: int
    seconds: float
    ramp_s: float
    jobs: int
    tokens_per_s: float
    mean_output_tokens: float
    completed_per_s: float
    statuses: dict[str, int]
    job_p50_s: float
    """A calibration job's median time from submission to its end."""
    others_cpu_s: float = 0.0
    """CPU seconds processes outside the run took meanwhile (set by the caller)."""

    @property
    def jobs_per_s(self) -> float:
        """The trace's jobs the measured token rate serves per second."""
        return self.tokens_per_s / self.mean_output_tokens

    @property
    def too_short(self) -> bool:
        """True when the jobs took so long against the window that it saw mostly one cohort of
        them decoding together (prefill under-counted): a longer run or fewer clients fits."""
        return self.job_p50_s > (self.seconds - self.ramp_s) / 2

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures."""
        return {
            "clients": self.clients,
            "seconds": self.seconds,
            "ramp_s": self.ramp_s,
            "jobs": self.jobs,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "mean_output_tokens": round(self.mean_output_tokens, 2),
            "capacity_jobs_per_s": round(self.jobs_per_s, 4),
            "completed_in_window_per_s": round(self.completed_per_s, 4),
            "statuses": self.statuses,
            "job_p50_s": round(self.job_p50_s, 3),
            "others_cpu_s": self.others_cpu_s,
        }


async def calibrate(
    api_url: str,
    key: str,
    requests: Iterator[TraceRequest],
    clients: int,
    seconds: float,
    mean_output_tokens: float,
) -> Calibration:
    """Keep `clients` jobs in flight on inferq for `seconds` (each client submits its next job
    as soon as its last one ends), all with one key so the tiers do not compete.

    Capacity is the output tokens made after a ramp (a fifth of the run, at most 10 s), counted
    as `Outcome.tokens_between` counts them from the jobs' records, then jobs still running at
    the end are waited out; divided by the trace's mean output length, that is jobs/s. Counting
    tokens rather than finished jobs keeps jobs longer than the run from biasing it.
    """
    jobs: list[dict[str, Any]] = []
    start = time.time()
    stop = start + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        while time.time() < stop:
            jobs.append(await inferq_job(session, key, next(requests)))

    async with client_session(api_url) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    ramp = min(seconds / 5, 10.0)
    tokens = completed = 0.0
    statuses: dict[str, int] = {}
    durations = [job["timings"]["total_s"] for job in jobs if job["timings"]["total_s"]]
    for job in jobs:
        first, end = job_times(job)
        made = Outcome("premium", start, seconds, "completed", first, end, job_tokens(job))
        tokens += made.tokens_between(start + ramp, stop)
        completed += job["status"] == "succeeded" and end is not None and start + ramp <= end < stop
        statuses[job["status"]] = statuses.get(job["status"], 0) + 1
    window = seconds - ramp
    return Calibration(
        clients=clients,
        seconds=seconds,
        ramp_s=ramp,
        jobs=len(jobs),
        tokens_per_s=tokens / window,
        mean_output_tokens=mean_output_tokens,
        completed_per_s=completed / window,
        statuses=statuses,
        job_p50_s=percentile(durations, 50),
    )
