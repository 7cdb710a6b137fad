"""The vLLM engine adapter: one AsyncLLM on an event loop in a background thread.

The runner's starter thread calls `submit`, which schedules the generation on the loop and
returns a future; vLLM batches every request in flight (continuous batching). The engine hands each
request's text over every `stream_tokens` tokens; it is collected per engine step and handed to
the delta sink once per step, never once per token. How often adapts to load: steps go out at
once while the engine runs few requests, and are coalesced as it runs more, so that a stream's
events stay near `STREAM_EVENTS_PER_S` a second in all, however many jobs run; no delta waits
longer than `stream_interval_ms`.
This is the only module that imports vLLM, and it is imported only after the worker has pinned
its devices.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from datetime import UTC, datetime
from typing import Any

from core.adapters import Adapter
from core.settings import Settings
from core.states import JobStatus
from workers.devices import cpu_has_native_bf16, lower_engine_core_priority
from workers.generation import Delta, DeltaSink, GenerationRequest, GenerationResult
from workers.prompt_ids import PrefixTokens

log = logging.getLogger(__name__)

STREAM_EVENTS_PER_S = 1280
"""What the worker's hand-overs aim at, in job deltas a second: each running request makes at
most one delta per hand-over. It bounds the events the API relays under load (2 vCPUs, tiny
model, 64 jobs x 256 tokens with an SSE reader each: 4,089 events with a hand-over every step,
2,559-3,096 at the 50 ms bound); the throughput difference was within run-to-run noise."""


def _lora_request(adapter: Adapter | None) -> Any:
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    # vLLM tells adapters apart by id: a name registered again has a new one (core.adapters).
    return LoRARequest(adapter.name, adapter.id, adapter.path)


def engine_args(
    settings: Settings, *, device: str, num_gpus: int, log_stats: bool = False
) -> dict[str, Any]:
    """vLLM engine arguments from inferq's settings."""
    memory = settings.gpu_memory_utilization
    if memory is None:
        memory = 0.2 if device == "cpu" else 0.9
    dtype = settings.dtype
    if dtype == "auto" and device == "cpu" and not cpu_has_native_bf16():
        # A bf16 checkpoint (the demo model's) ran 5x slower in emulated bf16 than in float32
        # on an AVX2 host (64 jobs x 32 tokens: 24 against 118 tokens/s).
        dtype = "float32"
    args: dict[str, Any] = {
        "model": settings.model_path,
        "served_model_name": settings.model_name,
        "dtype": dtype,
        "max_model_len": settings.max_model_len,
        "tensor_parallel_size": settings.tensor_parallel_size or max(1, num_gpus),
        "quantization": settings.quantization,
        "gpu_memory_utilization": memory,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "max_num_seqs": settings.max_num_seqs,
        "scheduling_policy": "priority",
        "disable_log_stats": not log_stats,
    }
    if settings.lora:
        args |= {
            "enable_lora": True,
            "max_loras": settings.lora_max_active,
            "max_lora_rank": settings.lora_max_rank,
        }
    return {k: v for k, v in args.items() if v is not None}


class VllmEngine:
    """An AsyncLLM driven from worker threads."""

    def __init__(
        self,
        settings: Settings,
        *,
        device: str = "cuda",
        num_gpus: int = 1,
        on_deltas: DeltaSink | None = None,
        stats_label: str | None = None,
    ) -> None:
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.cpu_kvcache_space_gb))
            # The CPU build cannot load its own ahead-of-time compile cache ("'function' object
            # has no attribute 'finalize_loading'") and compiles again at every start; the older
            # cache loads: the tiny model's engine is ready in 19 s instead of 24.5 s.
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        self._engine_core_nice = settings.cpu_engine_nice if device == "cpu" else 0
        self._args = engine_args(
            settings, device=device, num_gpus=num_gpus, log_stats=stats_label is not None
        )
        # With a label, the engine's KV-cache use and queue feed inferq's gauges.
        self._stats_label = stats_label
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-loop", daemon=True
        )
        self._tasks: dict[str, asyncio.Task[GenerationResult]] = {}
        self._stop_reasons: dict[str, JobStatus] = {}
        # Submitted but not yet running on the loop: a stop for these is kept until they start.
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._llm: Any = None
        self._prefix_tokens: PrefixTokens | None = None  # used on the loop's thread only
        self._on_deltas = on_deltas
        # Deltas of the current engine step; handed to the sink once the step's outputs are in.
        self._step: list[Delta] = []
        self._last_flush = 0.0
        self._stream_interval_s = settings.stream_interval_ms / 1000
        self._stream_tokens = settings.stream_tokens

    def start(self) -> None:
        """Load the model and start the engine; blocks until it is ready."""
        self._thread.start()
        self._run(self._create()).result()
        # vLLM reads its settings from the environment on every access until this is called,
        # which its engine core does and its front end does not: every request's statistics
        # read two variables on each step, 7.6% of the worker's Python time (py-spy, 256 x 64).
        from vllm.envs import enable_envs_cache

        enable_envs_cache()
        if self._engine_core_nice:
            # Measured on 2 cores, 256 x 512 tokens: +12% through the whole pipeline, +8% for
            # the engine alone, whose own front end also waited behind the spinning loop.
            changed = lower_engine_core_priority(self._engine_core_nice)
            log.info("engine core %s runs at nice %d", changed, self._engine_core_nice)
        log.info("engine ready: %s", self._args["model"])

    def kv_cache_tokens(self) -> int | None:
        """Tokens the engine's KV cache holds (known once it started); None if it did not say."""
        cache = getattr(getattr(self._llm, "vllm_config", None), "cache_config", None)
        blocks = getattr(cache, "num_gpu_blocks", None)
        size = getattr(cache, "block_size", None)
        return int(blocks * size) if blocks and size else None

    async def _create(self) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        loggers = None if self._stats_label is None else [_gauges_logger(self._stats_label)]
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._args), stat_loggers=loggers)
        tokenizer = self._llm.tokenizer
        self._prefix_tokens = None if tokenizer is None else PrefixTokens(tokenizer)

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        """Start generating; the future resolves with the result, whatever the outcome."""
        with self._lock:
            self._pending.add(request.request_id)
        return self._run(self._generate(request))

    def cancel(self, request_id: str) -> bool:
        """Abort a request in the engine; its result is `cancelled` with the partial text."""
        return self._stop(request_id, JobStatus.CANCELLED)

    def _stop(self, request_id: str, reason: JobStatus) -> bool:
        with self._lock:
            task = self._tasks.get(request_id)
            if task is None and request_id not in self._pending:
                return False
            self._stop_reasons[request_id] = reason
        if task is not None:
            self._loop.call_soon_threadsafe(task.cancel)
        return True

    async def _generate(self, request: GenerationRequest) -> GenerationResult:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        task = asyncio.current_task()
        assert task is not None
        result = GenerationResult(status=JobStatus.RUNNING)
        with self._lock:
            self._pending.discard(request.request_id)
            stopped_early = self._stop_reasons.pop(request.request_id, None)
            if stopped_early is None:
                self._tasks[request.request_id] = task
        if stopped_early is not None:  # stopped before it reached the engine
            result.status = stopped_early
            result.finish_reason = "cancelled"
            return result
        try:
            # Inside the try: parameters the engine refuses fail the job, not the task.
            # Deltas in chunks of `stream_tokens`: the engine's front end wakes this coroutine,
            # and the worker handles a delta, once per chunk rather than once per token.
            params = SamplingParams(
                **request.sampling,
                output_kind=RequestOutputKind.DELTA,
                stream_interval=self._stream_tokens,
            )
            async with asyncio.timeout(request.timeout_s):
                stream = self._llm.generate(
                    self._engine_prompt(request),
                    params,
                    request.request_id,
                    priority=request.priority,
                    lora_request=_lora_request(request.adapter),
                )
                async for output in stream:
                    text, tokens = _absorb(result, output)
                    self._add_delta(Delta(request.job_id, request.attempt, text, tokens))
            result.status = JobStatus.SUCCEEDED
        except TimeoutError:
            result.status = JobStatus.TIMED_OUT
            result.finish_reason = "timeout"
            result.error_code = "run_timeout"
            result.error_message = f"The job ran past its deadline of {request.timeout_s:g} s."
        except asyncio.CancelledError:
            with self._lock:
                reason = self._stop_reasons.pop(request.request_id, None)
            if reason is None:  # the loop itself is shutting down
                raise
            task.uncancel()
            result.status = reason
            result.finish_reason = "cancelled"
        except Exception as exc:  # the engine rejected or lost the request
            log.exception("generation failed for %s", request.request_id)
            result.status = JobStatus.FAILED
            result.error_code = "engine_error"
            result.error_message = f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._tasks.pop(request.request_id, None)
                self._stop_reasons.pop(request.request_id, None)
            # Every delta of this request is with the sink before its result is.
            self._flush_step()
        result.text = "".join(result.chunks)
        return result

    def _engine_prompt(self, request: GenerationRequest) -> Any:
        """The prompt's text, or its token ids where its shared prefix's are known."""
        prefix = request.shared_prefix
        if not prefix or request.adapter is not None or self._prefix_tokens is None:
            return request.prompt  # an adapter may bring a tokenizer of its own
        if not request.prompt.startswith(prefix):
            return request.prompt
        ids = self._prefix_tokens.ids(prefix, request.prompt[len(prefix) :], request.prompt_tokens)
        if ids is None:
            return request.prompt
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=ids)

    def _add_delta(self, delta: Delta) -> None:
        if self._on_deltas is None:
            return
        delta.at = time.time()
        if not self._step:
            # vLLM wakes every request of a step before a callback scheduled now runs, so a
            # flush sees the whole step; with a stream interval, it waits for later steps too.
            # Load-proportional: 8 requests, every 6 ms; 64 or more, the bound (50 ms).
            interval = min(self._stream_interval_s, len(self._tasks) / STREAM_EVENTS_PER_S)
            delay = self._last_flush + interval - delta.at
            if delay > 0:
                self._loop.call_later(delay, self._flush_step)
            else:
                self._loop.call_soon(self._flush_step)
        self._step.append(delta)

    def _flush_step(self) -> None:
        if self._step and self._on_deltas is not None:
            step, self._step = self._step, []
            self._last_flush = time.time()
            self._on_deltas(step)

    def shutdown(self) -> None:
        """Abort what is running, shut the engine down and stop the loop."""
        if self._llm is not None:
            for request_id in list(self._tasks):
                self._stop(request_id, JobStatus.CANCELLED)
            llm, self._llm = self._llm, None
            if self._loop.is_running():
                # On the loop's own thread, vLLM's output handler is cancelled before it can
                # see the engine core die (and log that as an error).
                self._run(_shutdown_engine(llm)).result(timeout=120)
            else:
                llm.shutdown()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)


async def _shutdown_engine(llm: Any) -> None:
    llm.shutdown()


def _absorb(result: GenerationResult, output: Any) -> tuple[str, int]:
    """Fold one step's output for a request into its result; returns the step's text and tokens."""
    completion = output.outputs[0]
    if completion.token_ids and result.first_token_at is None:
        result.first_token_at = datetime.now(UTC)
    result.chunks.append(completion.text)
    result.completion_tokens += len(completion.token_ids)
    if output.prompt_token_ids is not None and result.prompt_tokens is None:
        result.prompt_tokens = len(output.prompt_token_ids)
    if output.num_cached_tokens is not None:
        result.cached_prompt_tokens = output.num_cached_tokens
    if completion.finish_reason is not None:
        result.finish_reason = completion.finish_reason
    return completion.text, len(completion.token_ids)


def _gauges_logger(worker: str) -> Any:
    """A vLLM stat logger class that copies each step's scheduler stats into inferq's gauges."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    from core.metrics import ENGINE_WAITING, KV_CACHE_USAGE

    class GaugesLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                KV_CACHE_USAGE.labels(worker).set(scheduler_stats.kv_cache_usage)
                ENGINE_WAITING.labels(worker).set(scheduler_stats.num_waiting_reqs)

        def log_engine_initialized(self) -> None:
            pass

    return GaugesLogger
