"""The models a job may name: the served models, and the first one's registered LoRA adapters;
and the live workers that serve each (what their heartbeats publish, `core.workerinfo.Serving`).

A job names its model (`model` in every body; the first served model when left out): one of
the served models (`INFERQ_MODEL`, `INFERQ_MODELS`), or a registered adapter (`core.adapters`)
where the deployment serves adapters (`INFERQ_LORA`); else the request is refused before
anything is stored. A request for a served model costs no lookup; one naming adapters costs one
database read for all of them.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.concurrency import run_in_threadpool

from api.services import Services
from core import keys
from core.adapters import Adapter
from core.errors import ModelNotFound
from core.workerinfo import Serving


async def check_models(services: Services, names: Iterable[str | None]) -> None:
    """Raise ModelNotFound unless every name is a served model or a registered adapter."""
    served = set(services.models.names())
    wanted = {name for name in names if name is not None and name not in served}
    if not wanted:
        return
    found = (
        await run_in_threadpool(services.adapters.named, wanted) if services.settings.lora else {}
    )
    missing = sorted(wanted - set(found))
    if missing:
        raise ModelNotFound(_not_served(services, missing[0]), param="model")


async def served_adapters(services: Services) -> list[Adapter]:
    """The adapters jobs may name now (none while the deployment serves no adapters)."""
    if not services.settings.lora:
        return []
    return await run_in_threadpool(services.adapters.all)


async def serving_workers(services: Services) -> dict[str, Serving]:
    """Each live worker (its heartbeat current) and what it serves, by name."""
    members = sorted(
        name.decode() if isinstance(name, bytes) else str(name)
        for name in await services.redis.smembers(keys.WORKERS_SET)
    )
    if not members:
        return {}
    replies = await services.redis.mget([keys.worker_serves(name) for name in members])
    serving = {name: Serving.decode(raw) for name, raw in zip(members, replies, strict=True)}
    return {name: served for name, served in serving.items() if served is not None}


def _not_served(services: Services, name: str) -> str:
    served = "', '".join(services.models.names())
    if not services.settings.lora:
        return (
            f"The model '{name}' does not exist; this server serves '{served}' and no adapters "
            "(INFERQ_LORA is off)."
        )
    return (
        f"The model '{name}' does not exist; this server serves '{served}' and the adapters "
        "that GET /v1/models lists."
    )
