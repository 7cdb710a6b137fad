"""All configuration, read once from `INFERQ_*` environment variables (and `.env`)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from core.experiments import Experiment
from core.tiers import DEFAULT_TIER_POLICIES, Tier, TierPolicy


class Settings(BaseSettings):
    """inferq's settings; every field is `INFERQ_<NAME>` in the environment."""

    model_config = SettingsConfigDict(env_prefix="INFERQ_", env_file=".env", extra="ignore")

    data_dir: Path = Field(
        default=Path(".inferq"), description="Where the embedded defaults live: SQLite, model."
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Broker, pub/sub, streams and quotas: one server (`redis://host:port/db`), or "
        "the primary Redis Sentinel names (`redis+sentinel://[:password@]host:port,host:port/"
        "service/db`), followed through failovers.",
    )
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; default: SQLite file in data_dir."
    )
    model: str | None = Field(
        default=None,
        description="Hugging Face model id or directory; default: the model `inferq model init` "
        "made in data_dir/model.",
    )
    served_model_name: str | None = Field(
        default=None,
        description="The name clients use for the model (/v1/models, the OpenAI `model` field, "
        "job records), as vLLM's --served-model-name; default: the name `inferq model init` "
        "gave it, else the directory's name or the hub id.",
    )
    models: dict[str, str] = Field(
        default_factory=dict,
        description="More base models this deployment serves, as JSON: served name to Hugging "
        "Face id or directory. Each has queues of its own, taken by workers started with "
        "`inferq worker --model NAME`; the API counts its prompts with its tokenizer.",
    )

    # Passed through to vLLM's engine arguments.
    dtype: str = Field(
        default="auto",
        description="vLLM dtype; auto: the checkpoint's, except float32 on a CPU without "
        "native bf16 (AVX512-BF16 or AMX), where bf16 is emulated and several times slower.",
    )
    max_model_len: int | None = Field(default=None, description="Context length; default: model's.")
    tensor_parallel_size: int | None = Field(
        default=None, description="vLLM tensor parallelism; default: number of --gpus."
    )
    quantization: str | None = Field(default=None, description="vLLM quantization method.")
    gpu_memory_utilization: float | None = Field(
        default=None, description="Fraction of device memory for vLLM; default 0.9 GPU, 0.2 CPU."
    )
    enable_prefix_caching: bool = Field(default=True, description="vLLM automatic prefix cache.")
    max_num_seqs: int = Field(default=256, description="vLLM's running batch size limit.")
    cpu_kvcache_space_gb: int = Field(default=1, description="KV cache size on the CPU build.")
    lora: bool = Field(
        default=False,
        description="Serve the registered LoRA adapters (`inferq adapters`): jobs may name one "
        "as their model. The API refuses adapters while it is off; vLLM's CPU build runs "
        "without torch.compile with it on.",
    )
    lora_max_rank: int = Field(
        default=16, ge=1, description="The highest adapter rank the workers' engines hold."
    )
    experiments: dict[str, Experiment] = Field(
        default_factory=dict,
        description="A/B experiments as JSON: name to variants, each a weight and what it sets "
        '(model, temperature, top_p, max_tokens), e.g. {"tone": {"variants": {"control": '
        '{"weight": 90}, "adapter": {"weight": 10, "model": "support-tone"}}}}.',
    )
    lora_max_active: int = Field(
        default=4, ge=1, description="Adapters one engine step may mix (vLLM's max_loras)."
    )
    cpu_engine_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="CPU build: nice value of vLLM's engine-core process, whose loop spins "
        "beside the API, Redis and the worker's threads; 0: none.",
    )

    worker_concurrency: int = Field(
        default=256, description="Jobs a worker keeps in flight in its engine at once."
    )
    lease_ttl_s: float = Field(
        default=30.0,
        description="A worker's claim on a job lapses this long after its last renewal (the "
        "backstop: a dead worker is noticed sooner, when its name's claim lapses).",
    )
    worker_name_ttl_s: float = Field(
        default=5.0,
        gt=0.5,
        description="A worker that stops renewing its name (it died, lost its network, or "
        "stalled) is taken for lost this long after its last renewal, and its jobs are handed "
        "on. Longer where a live worker may stall for seconds (an overloaded CPU host).",
    )
    api_redis_connections: int = Field(
        default=2000,
        ge=10,
        description="Redis connections per API process (live streams share one of their own).",
    )
    stream_interval_ms: int = Field(
        default=50,
        ge=0,
        description="Longest time a worker holds a token stream's deltas to publish them "
        "together: it publishes every engine step while it runs few jobs, and coalesces steps "
        "up to this bound as it runs more; 0: every engine step, whatever the load.",
    )
    stream_tokens: int = Field(
        default=4,
        ge=1,
        description="Tokens the engine gathers for a job before handing them on (vLLM's "
        "per-request stream_interval; the first and the last come at once); 1: every token.",
    )
    max_attempts: int = Field(
        default=3, ge=1, description="Runs of a job whose worker is lost before it fails."
    )
    dispatch_backlog: int = Field(
        default=128,
        ge=1,
        description="Messages a tier queue holds before further jobs wait in per-owner lists "
        "that the scheduler drains round-robin (fair share).",
    )
    edge_batch: int = Field(
        default=32,
        ge=1,
        description="Most jobs a worker with free slots takes from the queues in one Redis "
        "round trip (edge batching); 1: one message a round trip, as Celery takes them.",
    )
    prefix_route_chars: int = Field(
        default=1024,
        ge=0,
        description="Prompts at least this long go to the worker their first this-many "
        "characters hash to, so its prefix cache serves what they share; 0: no routing.",
    )
    prefix_route_backlog: int = Field(
        default=64,
        ge=1,
        description="A routed job goes to the shared tier queue instead when its worker "
        "already has this many jobs waiting in its own queue.",
    )
    scheduler_interval_s: float = Field(
        default=1.0, gt=0, description="How often `inferq scheduler` expires and reaps jobs."
    )
    worker_metrics_port: int = Field(
        default=9101, ge=0, description="Port of a worker's /metrics (0: none)."
    )
    scheduler_metrics_port: int = Field(
        default=9102, ge=0, description="Port of the scheduler's /metrics (0: none)."
    )
    log_format: Literal["json", "text"] = Field(
        default="json", description="json: one object per line with job id, tier and worker."
    )
    flower_basic_auth: str | None = Field(
        default=None,
        description="user:password for Flower; `inferq flower` needs it.",
    )
    otlp_endpoint: str | None = Field(
        default=None, description="OTLP/HTTP collector for traces, e.g. http://otel:4318."
    )
    celery_mode: Literal["inferq", "stock"] = Field(
        default="inferq",
        description="inferq: workers take jobs in bulk, per tier, with inferq's task strategy, "
        "and the API builds messages itself, all tested on the pinned Celery and kombu; stock: "
        "Celery's own transport, strategy and send_task, for any Celery version (slower; no "
        "per-tier room in the worker).",
    )
    task_events: bool = Field(
        default=False,
        description="Send Celery task events (Flower's task pages); costs Redis traffic per job.",
    )
    engine_metrics: bool = Field(
        default=True,
        description="vLLM's per-step statistics: the KV-cache and engine-queue gauges and vLLM's "
        "own vllm:* metrics; they cost the engine's front end CPU for every token.",
    )
    tiers: dict[Tier, TierPolicy] = Field(
        default_factory=lambda: dict(DEFAULT_TIER_POLICIES),
        description='Tier policy as JSON, e.g. {"basic": {"priority": 0, ...}}.',
    )
    auth_cache_ttl_s: float = Field(
        default=5.0,
        ge=0,
        description="How long the API trusts a checked key; a revoked key works up to this long.",
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Browser origins allowed to call the API (CORS), comma-separated or a JSON "
        "list, e.g. https://app.example.com; empty: no CORS headers at all.",
    )
    default_max_tokens: int = Field(default=256, description="max_tokens when a job omits it.")
    max_body_bytes: int = Field(default=1024 * 1024, description="Largest accepted request body.")
    job_key_ttl_s: int = Field(
        default=24 * 3600, gt=0, description="TTL of every per-job Redis key."
    )
    retention_days: float = Field(
        default=30.0,
        ge=0,
        description="Finished jobs (and finished batches with their jobs and result files) "
        "older than this are deleted by `inferq scheduler` and `inferq db purge`; 0: keep forever.",
    )
    retention_interval_s: float = Field(
        default=3600.0, gt=0, description="How often `inferq scheduler` purges old rows."
    )
    retention_chunk: int = Field(
        default=1000, ge=1, description="Rows the retention purge deletes per transaction."
    )
    result_cache_ttl_s: int = Field(
        default=3600,
        ge=0,
        description="How long a deterministic job's result answers its repeats; 0: no cache.",
    )
    merge_requests: bool = Field(
        default=True,
        description="Identical deterministic jobs in flight on a worker share one engine request.",
    )
    deadline_pacing: bool = Field(
        default=True,
        description="While a running job's tokens come too slowly to meet its deadline, the "
        "tiers below it take no new jobs on its worker, so the batch shrinks and each engine "
        "step gets faster.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="The least severe level every inferq process logs."
    )

    tiers_file: Path | None = Field(
        default=None,
        description="JSON file with a tier table like INFERQ_TIERS; INFERQ_TIERS overrides it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _read_tiers_file(cls, data: Any) -> Any:
        """Layer the tier table: defaults, then the file, then INFERQ_TIERS."""
        if not isinstance(data, dict) or not data.get("tiers_file"):
            return data
        path = Path(data["tiers_file"])
        try:
            from_file = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the tiers file {path}: {exc}") from exc
        if not isinstance(from_file, dict):
            raise ValueError(f"the tiers file {path} must hold a JSON object of tiers")
        override = data.get("tiers") or {}
        if isinstance(override, str):
            override = json.loads(override)
        merged = {
            name: {**from_file.get(name, {}), **override.get(name, {})}
            for name in {*from_file, *override}
        }
        return {**data, "tiers": merged}

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _split_origins(cls, value: Any) -> Any:
        """Accept `a,b` as well as `["a", "b"]`; an origin has no trailing slash."""
        if isinstance(value, str):
            text = value.strip()
            value = json.loads(text) if text.startswith("[") else text.split(",")
        if isinstance(value, list):
            return [str(origin).strip().rstrip("/") for origin in value if str(origin).strip()]
        return value

    @field_validator("tiers", mode="before")
    @classmethod
    def _merge_tier_defaults(cls, value: Any) -> Any:
        """Let a partial tier table override only the tiers and fields it names."""
        if not isinstance(value, dict):
            return value
        unknown = set(value) - {t.value for t in Tier}
        if unknown:
            raise ValueError(
                f"unknown tier name(s) {sorted(unknown)}; tiers are {[t.value for t in Tier]}"
            )
        merged: dict[str, Any] = {}
        for tier, default in DEFAULT_TIER_POLICIES.items():
            override = value.get(tier.value, {})
            if isinstance(override, TierPolicy):
                override = override.model_dump()
            merged[tier.value] = {**default.model_dump(), **override}
        return merged

    @property
    def sqlalchemy_url(self) -> str:
        """The database URL, defaulting to a SQLite file under data_dir."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'inferq.db').resolve()}"

    @property
    def model_path(self) -> str:
        """The model vLLM loads: the configured one, else the local model."""
        return self.model or str((self.data_dir / "model").resolve())

    @property
    def uses_local_model(self) -> bool:
        """True when no model is configured and the one in data_dir/model is used."""
        return self.model is None

    @property
    def model_name(self) -> str:
        """The model's served name (see `core.modelinfo.served_model_name`)."""
        from core.modelinfo import served_model_name

        return served_model_name(self.model_path, self.served_model_name)

    def lane_of(self, model: str | None) -> str | None:
        """The lane (`core.keys.queue_name`) of a job's model: its own for a model of
        `models`, None (the first model's queues) for the first model and its adapters."""
        return model if model is not None and model in self.models else None

    @property
    def lanes(self) -> list[str | None]:
        """Every lane: None (the first model's), then each model of `models`."""
        return [None, *sorted(self.models)]

    def serving(self, name: str) -> Settings:
        """These settings for a worker that serves `name`, one of `models` (or the first)."""
        if name == self.model_name:
            return self
        if name not in self.models:
            known = ", ".join([self.model_name, *sorted(self.models)])
            raise ValueError(f"unknown model {name!r}; this deployment serves {known}")
        # Registered adapters are the first model's: the other models' workers load none.
        update = {"model": self.models[name], "served_model_name": name, "lora": False}
        return self.model_copy(update=update)

    def tier_policy(self, tier: Tier | str) -> TierPolicy:
        """The policy of one tier."""
        return self.tiers[Tier(tier)]


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings, read once."""
    return Settings()
