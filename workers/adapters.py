"""Which LoRA adapter each job runs with, read from the registry once per batch of starts.

A job names its model: the served one runs on the base model; any other name is an adapter
(`core.adapters`), looked up when the job starts. A job whose adapter was removed since it was
accepted, that reached a worker serving no adapters, or that names another base model (whose
queues this worker does not read, so only a message sent before the deployment's models changed
gets here), cannot run here: it fails with a code that says why, without touching the engine.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from core.adapters import Adapter, AdapterStore
from core.models import Job


@dataclass(frozen=True)
class Refusal:
    """Why a job cannot run on this worker."""

    error_code: str
    message: str


class JobAdapters:
    """Resolves jobs' models to adapters for one worker."""

    def __init__(
        self, store: AdapterStore, served: str, enabled: bool, others: Collection[str] = ()
    ) -> None:
        self.store = store
        self.served = served
        self.enabled = enabled
        self.others = others
        """The deployment's other base models (`Settings.models`)."""

    def resolve(self, jobs: Iterable[Job]) -> tuple[dict[str, Adapter], dict[str, Refusal]]:
        """(job id → its adapter, job id → why it cannot run) for the jobs that name one."""
        named = {job.id: job.model for job in jobs if job.model and job.model != self.served}
        elsewhere = {job_id: name for job_id, name in named.items() if name in self.others}
        refused = {
            job_id: Refusal(
                "model_not_served",
                f"The model '{name}' runs on other workers, not '{self.served}'.",
            )
            for job_id, name in elsewhere.items()
        }
        named = {job_id: name for job_id, name in named.items() if job_id not in elsewhere}
        if not named:
            return {}, refused
        if not self.enabled:
            message = "This worker serves no LoRA adapters (INFERQ_LORA is off)."
            return {}, refused | {job_id: Refusal("model_not_served", message) for job_id in named}
        found = self.store.named(set(named.values()))
        adapters = {job_id: found[name] for job_id, name in named.items() if name in found}
        refused |= {
            job_id: Refusal("model_not_found", f"The adapter '{name}' is no longer registered.")
            for job_id, name in named.items()
            if name not in found
        }
        return adapters, refused
