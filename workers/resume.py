"""Resuming a lost run from the text its readers already have.

When a worker dies mid-generation, the scheduler requeues its jobs (see `scheduler.reaper`). A
job whose deltas were streamed (somebody watched it) does not start again from nothing: the
next worker reads the job's event stream, takes the text it adds up to (`core.events.
streamed_text`), and asks the engine to continue it — the prompt followed by that text, with
`max_tokens` less the tokens already made. Its `running` event says which events it continues
(`resumes_after`), so a reader that resumes by Last-Event-ID keeps one continuous text; the
stored result is that text plus the rest, and usage counts every token once. The job records
how many of its tokens came from the lost run (`resumed_tokens`).

The continuation is exact for greedy decoding when the text re-tokenizes to the tokens that
made it; a sampled job's sampler starts afresh. A job whose lost run was not watched had its
deltas held in the dead worker's memory: it starts again from the beginning, as does one
whose streamed tokens already reach its `max_tokens`.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import redis

from core import keys
from core.events import parse_events, streamed_text
from core.models import Job
from workers.generation import GenerationResult


@dataclass(frozen=True)
class Resume:
    """What a new run of a job continues: the streamed text, its tokens, its last event."""

    text: str
    tokens: int
    after_seq: int

    def prompt(self, prompt: str) -> str:
        """The engine's prompt: the job's (`prompt`), then the text already streamed."""
        return prompt + self.text

    def sampling(self, job: Job) -> dict[str, Any]:
        """The job's sampling parameters for what is left to generate."""
        sampling = dict(job.sampling_params)
        sampling["max_tokens"] = int(sampling["max_tokens"]) - self.tokens
        return sampling

    def joined(self, job: Job, result: GenerationResult) -> GenerationResult:
        """The whole job's result from the continuation's: text and tokens of both runs."""
        return replace(
            result,
            text=self.text + result.text,
            completion_tokens=self.tokens + result.completion_tokens,
            # The engine counted the streamed text as prompt; the job's prompt is its own.
            prompt_tokens=job.prompt_tokens,
            resumed_tokens=self.tokens,
        )


def read_resumes(client: redis.Redis, jobs: list[Job]) -> dict[str, Resume]:
    """For each job starting a later run, what it can continue (absent: start from nothing).

    One round trip for all of them; only jobs on their second or later attempt are read.
    """
    later = [job for job in jobs if job.attempt > 1]
    if not later:
        return {}
    pipe = client.pipeline(transaction=False)
    for job in later:
        pipe.xrange(keys.job_event_stream(job.id))
    resumes = {}
    for job, reply in zip(later, pipe.execute(), strict=True):
        events = parse_events(reply)
        text, tokens = streamed_text(events)
        max_tokens = job.sampling_params.get("max_tokens")
        if not text or max_tokens is None or tokens >= int(max_tokens):
            continue
        resumes[job.id] = Resume(text, tokens, after_seq=events[-1]["seq"])
    return resumes


def joined_when_done(
    generation: Future[GenerationResult], job: Job, resume: Resume
) -> Future[GenerationResult]:
    """A future of the whole job's result, resolved when the continuation's resolves."""
    joined: Future[GenerationResult] = Future()

    def _done(done: Future[GenerationResult]) -> None:
        error = done.exception()
        if error is not None:
            joined.set_exception(error)
        else:
            joined.set_result(resume.joined(job, done.result()))

    generation.add_done_callback(_done)
    return joined
