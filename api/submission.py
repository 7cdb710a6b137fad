"""Turning a validated request into a stored, enqueued job (cancelling: `api.cancelling`)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

from opentelemetry.trace import SpanKind
from starlette.concurrency import run_in_threadpool

from api.admission import admit_to_queue
from api.cache import announce_cached, cache_key_for, fill_from_cache
from api.catalog import check_models
from api.experiments import with_variant
from api.openai.chat_prompt import render_chat
from api.schemas import JobCreate
from api.services import Services
from core.apikeys import Principal
from core.errors import (
    ClientError,
    ContextLengthExceeded,
    TierLimitExceeded,
)
from core.metrics import count_submitted
from core.modelinfo import ModelInfo
from core.models import Batch, Job
from core.new_jobs import NewJob
from core.prompts import (
    CountedPrompts,
    SharedPrefix,
    count_prompts,
    text_digest,
    whole_digests,
)
from core.queue.dispatch import queued
from core.queue.routing import prefix_key
from core.quotas import Admission
from core.tracing import current_headers, tracer

log = logging.getLogger(__name__)

T = TypeVar("T")

INLINE_PROMPT_CHARS = 1024
"""A prompt up to this long is tokenized on the event loop (tens of µs); a longer one in a thread,
where its milliseconds do not hold up every other request."""


def check_against_tier(services: Services, principal: Principal, body: JobCreate) -> int:
    """The job's max_tokens after checking the request against its key's tier."""
    policy = services.settings.tier_policy(principal.tier)
    if body.max_tokens is not None and body.max_tokens > policy.max_tokens:
        raise TierLimitExceeded(
            f"max_tokens {body.max_tokens} is over the {principal.tier.value} tier's limit "
            f"of {policy.max_tokens}.",
            param="max_tokens",
        )
    if body.timeout_s is not None and body.timeout_s > policy.timeout_s:
        raise TierLimitExceeded(
            f"timeout_s {body.timeout_s:g} is over the {principal.tier.value} tier's limit "
            f"of {policy.timeout_s:g} s.",
            param="timeout_s",
        )
    return body.max_tokens or min(services.settings.default_max_tokens, policy.max_tokens)


def check_context(
    services: Services, model: str | None, prompt_tokens: int, max_tokens: int
) -> None:
    """Reject a job whose prompt and completion cannot fit its model's context."""
    limit = services.models.of(model).max_model_len
    if prompt_tokens + max_tokens > limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens; the prompt has "
            f"{prompt_tokens} tokens and max_tokens asks for {max_tokens} more.",
            param="prompt",
        )


async def submit_job(
    services: Services, principal: Principal, body: JobCreate, idempotency_key: str | None
) -> tuple[Job, bool]:
    """Validate, store, then enqueue; returns the job and whether it is new.

    The row is committed before the id is enqueued, so a worker never sees an id it cannot load.
    Without an idempotency key the job is stored in a group commit with the jobs submitted at
    the same moment (see `api.batcher`).
    """
    with tracer().start_as_current_span("inferq.submit", kind=SpanKind.PRODUCER) as span:
        headers = current_headers()
        if body.text_length() <= INLINE_PROMPT_CHARS:  # a hop to a thread costs more
            new = new_job(services, principal, body, idempotency_key, headers)
        else:
            new = await run_in_threadpool(
                new_job, services, principal, body, idempotency_key, headers
            )
        await check_models(services, [new.model])
        if idempotency_key is not None:
            existing = await run_in_threadpool(services.jobs.replay, new)
            if existing is not None:  # a replay costs no quota
                return existing, False
        [new] = await fill_from_cache(services, [new])
        if new.cached is None:
            await admit_to_queue(services.queue_state, [new])
        await admit(services, principal, [new])
        if idempotency_key is not None or new.cached is not None:
            job, created = await run_in_threadpool(_submit_blocking, services, new)
        else:
            job, created = await services.submissions.submit(new), True
        if created and new.cached is not None:
            await announce_cached(services, [job])
        span.set_attributes({"inferq.job_id": job.id, "inferq.tier": job.tier})
        return job, created


async def admit(services: Services, principal: Principal, jobs: list[NewJob]) -> None:
    """Count the jobs against the key's quota, or raise 429 (nothing is stored then)."""
    await services.quotas.admit(
        principal.key_id,
        principal.quota,
        [
            Admission(
                job.id,
                job.prompt_tokens + int(job.sampling_params.get("max_tokens", 0)),
                time.time() + job.timeout_s + 60,
            )
            for job in jobs
        ],
    )


def _submit_blocking(services: Services, new: NewJob) -> tuple[Job, bool]:
    job, created = services.jobs.create(new)
    if created:
        if new.cached is None:
            services.dispatcher.submit_or_defer(
                queued([job], [new.trace_headers], route_chars=services.settings.prefix_route_chars)
            )
        count_submitted([job.tier])
    return job, created


async def submit_jobs(
    services: Services,
    principal: Principal,
    bodies: list[JobCreate],
    *,
    batch_row: Batch | None = None,
    custom_ids: list[str] | None = None,
    prompts: CountedPrompts | None = None,
) -> list[Job]:
    """Validate every job, store them all in one transaction, then enqueue them all.

    One bad job rejects the whole batch (its index in `param`), before anything is stored.
    With `batch_row`, the jobs belong to that batch (in order, with `custom_ids` if given) and
    the row is stored in the same transaction. `prompts`: the jobs' prompts, already made and
    counted (by default each job's is made from its body; see `core.prompts` for the sharing).
    """
    with tracer().start_as_current_span("inferq.submit_batch", kind=SpanKind.PRODUCER) as span:
        span.set_attribute("inferq.jobs", len(bodies))
        headers = current_headers()
        batch = await run_in_threadpool(_new_jobs, services, principal, bodies, headers, prompts)
        await check_models(services, {new.model for new in batch})
        if batch_row is not None:
            batch = [
                replace(
                    new,
                    batch_id=batch_row.id,
                    batch_index=index,
                    custom_id=custom_ids[index] if custom_ids else None,
                )
                for index, new in enumerate(batch)
            ]
        batch = await fill_from_cache(services, batch)
        await admit_to_queue(services.queue_state, [new for new in batch if new.cached is None])
        await admit(services, principal, batch)
        also = [batch_row] if batch_row is not None else []
        jobs = await run_in_threadpool(_store_many, services, batch, headers, also)
        await announce_cached(services, [job for job in jobs if job.served_from is not None])
        return jobs


def _new_jobs(
    services: Services,
    principal: Principal,
    bodies: list[JobCreate],
    headers: dict[str, str],
    prompts: CountedPrompts | None,
) -> list[NewJob]:
    if prompts is None:
        models = [
            _indexed(index, model_of, services, principal, body)
            for index, body in enumerate(bodies)
        ]
        rendered = [
            _indexed(index, prompt_of, model, body)
            for index, (model, body) in enumerate(zip(models, bodies, strict=True))
        ]
        if all(model is models[0] for model in models):
            prompts = count_prompts(models[0], rendered)
        else:  # each prompt counted by its own model's tokenizer, nothing shared
            counts = [m.count_tokens(text) for m, text in zip(models, rendered, strict=True)]
            prompts = CountedPrompts(None, rendered, counts)
    digests = whole_digests(prompts)
    return [
        _indexed(
            index,
            _job_of,
            services,
            principal,
            body,
            PromptParts(
                prompts.rests[index], prompts.tokens[index], prompts.prefix, digests[index]
            ),
            None,
            headers,
        )
        for index, body in enumerate(bodies)
    ]


def _indexed(index: int, make: Callable[..., T], *args: Any) -> T:
    """`make(*args)`, a client error in it said of `jobs[index]`."""
    try:
        return make(*args)
    except ClientError as exc:
        exc.message = f"jobs[{index}]: {exc.message}"
        exc.param = f"jobs[{index}].{exc.param}" if exc.param else f"jobs[{index}]"
        raise


def _store_many(
    services: Services, batch: list[NewJob], headers: dict[str, str], also: list[Batch]
) -> list[Job]:
    jobs = services.jobs.create_many(batch, also)
    chars = services.settings.prefix_route_chars
    waiting = [
        (job, prefix_key(new.prompt_start(chars), chars))
        for job, new in zip(jobs, batch, strict=True)
        if job.served_from is None
    ]
    waiting = _repeats_together(waiting)
    services.dispatcher.submit_or_defer(
        queued(
            [job for job, _ in waiting],
            [headers] * len(waiting),
            routes=[route for _, route in waiting],
            route_chars=chars,
        )
    )
    count_submitted(job.tier for job in jobs)
    return jobs


def _repeats_together(waiting: list[tuple[Job, str | None]]) -> list[tuple[Job, str | None]]:
    """The batch in enqueue order: each repeat of a deterministic job right after its first.

    Repeats then start while the first runs, and the worker merges them into its engine run
    (`workers.merging`) instead of running the same request again once it has ended.
    """
    first: dict[str, int] = {}
    place = [
        first.setdefault(job.cache_key, index) if job.cache_key else index
        for index, (job, _) in enumerate(waiting)
    ]
    return [waiting[index] for index in sorted(range(len(waiting)), key=place.__getitem__)]


@dataclass(frozen=True)
class PromptParts:
    """A job's prompt as it will be stored: what follows `prefix` (if any), and its counts."""

    rest: str
    tokens: int
    prefix: SharedPrefix | None
    digest: Callable[[], str]
    """The whole prompt's `text_digest` (computed only if asked for)."""


def model_of(services: Services, principal: Principal, body: JobCreate) -> ModelInfo:
    """The model the job will run on: the one it names, or its experiment's variant's."""
    return services.models.of(with_variant(services.settings, principal, body)[0].model)


def prompt_of(model: ModelInfo, body: JobCreate) -> str:
    """The job's prompt: as given, or its messages rendered with its model's chat template."""
    if body.prompt is not None:
        return body.prompt
    return render_chat(model, body.message_dicts())


def new_job(
    services: Services,
    principal: Principal,
    body: JobCreate,
    idempotency_key: str | None,
    trace_headers: dict[str, str] | None = None,
) -> NewJob:
    """The job to store for a request, after checking it against its tier and the model."""
    model = model_of(services, principal, body)
    prompt = prompt_of(model, body)
    parts = PromptParts(
        prompt,
        model.count_tokens(prompt),
        None,
        partial(text_digest, prompt),
    )
    return _job_of(services, principal, body, parts, idempotency_key, trace_headers)


def _job_of(
    services: Services,
    principal: Principal,
    body: JobCreate,
    prompt: PromptParts,
    idempotency_key: str | None,
    trace_headers: dict[str, str] | None,
) -> NewJob:
    request_hash = None
    if idempotency_key is not None:
        # Fields left out hash as they did before jobs could name a model or an experiment.
        unset = {name for name in ("model", "experiment", "user") if getattr(body, name) is None}
        canonical = json.dumps(body.model_dump(exclude=unset), sort_keys=True)
        request_hash = hashlib.sha256(canonical.encode()).hexdigest()
    body, arm = with_variant(services.settings, principal, body)
    max_tokens = check_against_tier(services, principal, body)
    check_context(services, body.model, prompt.tokens, max_tokens)
    policy = services.settings.tier_policy(principal.tier)
    timeout_s = body.timeout_s or policy.timeout_s
    sampling = body.sampling_params(max_tokens)
    model = body.model or services.model.name  # `check_models` checks it before storing
    return NewJob(
        owner=principal.owner,
        tier=principal.tier.value,
        prompt=prompt.rest,
        prompt_prefix=prompt.prefix,
        model=model,
        sampling_params=sampling,
        timeout_s=timeout_s,
        queue_timeout_s=policy.queue_limit_s(timeout_s),
        prompt_tokens=prompt.tokens,
        idempotency_key=idempotency_key,
        request_hash=request_hash,
        cache_key=cache_key_for(services, model, prompt.digest, sampling, body.cache),
        trace_headers=trace_headers or {},
        experiment=arm.experiment if arm else None,
        variant=arm.variant if arm else None,
        end_user=arm.user if arm else body.user,
    )
