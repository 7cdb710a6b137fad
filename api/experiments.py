"""Putting a job in its A/B experiment: the variant for its user, applied to its request."""

from __future__ import annotations

from dataclasses import dataclass

from api.schemas import JobCreate
from core.apikeys import Principal
from core.errors import ExperimentNotFound
from core.settings import Settings


@dataclass(frozen=True)
class Arm:
    """Where a job stands in its experiment."""

    experiment: str
    variant: str
    user: str


def with_variant(
    settings: Settings, principal: Principal, body: JobCreate
) -> tuple[JobCreate, Arm | None]:
    """The request as its experiment's variant sets it, and the arm; unchanged outside one."""
    if body.experiment is None:
        return body, None
    experiment = settings.experiments.get(body.experiment)
    if experiment is None:
        raise ExperimentNotFound(
            f"No experiment named '{body.experiment}' (INFERQ_EXPERIMENTS).", param="experiment"
        )
    user = body.user or principal.owner
    variant = experiment.assign(body.experiment, user)
    changed = body.model_copy(update=experiment.variants[variant].overrides())
    return changed, Arm(body.experiment, variant, user)
