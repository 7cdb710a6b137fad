"""LoRA adapters: registered by name and path, selected by naming one as a job's model.

An operator registers an adapter of the served model (`inferq adapters add NAME PATH`); from
then on a job whose `model` is NAME runs with it, on any worker started with
`INFERQ_LORA=true`, in the same engine batches as the base model's jobs (vLLM applies each
request's adapter in its step). The path is read by the workers, which load an adapter on its
first job; the registry is the database, so the API and every worker see the same adapters.

A name registered again after its removal gets a new id: the engines tell adapters apart by
id, so a worker that loaded the old weights never serves them under the name again. A job runs
with the adapter registered under its model's name when it starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from core.db import Database
from core.errors import Conflict, InvalidRequest
from core.models import LoraAdapter

ADAPTER_CONFIG = "adapter_config.json"
"""The file that makes a directory a (PEFT) LoRA adapter."""


@dataclass(frozen=True)
class Adapter:
    """A registered adapter as the API and the workers use it."""

    id: int
    name: str
    path: str
    rank: int | None

    @classmethod
    def of(cls, row: LoraAdapter) -> Adapter:
        return cls(row.id, row.name, row.path, row.rank)


class AdapterExists(Conflict):
    """An adapter of that name is registered already."""

    code = "adapter_exists"


def adapter_rank(path: Path) -> int:
    """The LoRA rank in the adapter directory's config; InvalidRequest if it is not an adapter."""
    config = path / ADAPTER_CONFIG
    try:
        rank = json.loads(config.read_text())["r"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidRequest(
            f"{path} is not a LoRA adapter: no readable {ADAPTER_CONFIG} with its rank `r`.",
            param="path",
        ) from exc
    if not isinstance(rank, int) or rank < 1:
        raise InvalidRequest(f"{config}: the rank `r` must be a positive integer.", param="path")
    return rank


class AdapterStore:
    """The registry of adapters, in the database."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def add(self, name: str, path: Path, max_rank: int | None = None) -> Adapter:
        """Register the adapter in `path` (an absolute directory) as `name`.

        Checked here, so a job never fails on it later: the directory holds an adapter, and its
        rank is at most `max_rank` (what the workers' engines are started to hold).
        """
        if not name or name != name.strip() or "/" in name:
            raise InvalidRequest(f"Bad adapter name {name!r}: no slashes or spaces around it.")
        if not path.is_absolute():
            raise InvalidRequest(f"{path}: give the adapter's absolute path.", param="path")
        rank = adapter_rank(path)
        if max_rank is not None and rank > max_rank:
            raise InvalidRequest(
                f"The adapter's rank {rank} is over the workers' limit of {max_rank} "
                "(INFERQ_LORA_MAX_RANK).",
                param="path",
            )
        row = LoraAdapter(name=name, path=str(path), rank=rank)
        try:
            with self.db.session() as session:
                session.add(row)
        except IntegrityError as exc:
            raise AdapterExists(f"An adapter named '{name}' is registered already.") from exc
        return Adapter.of(row)

    def remove(self, name: str) -> bool:
        """Unregister the adapter; False if there was none of that name."""
        with self.db.session() as session:
            removed = session.execute(delete(LoraAdapter).where(LoraAdapter.name == name))
            return bool(getattr(removed, "rowcount", 0))

    def all(self) -> list[Adapter]:
        """Every registered adapter, the oldest first."""
        with self.db.session() as session:
            rows = session.scalars(select(LoraAdapter).order_by(LoraAdapter.id))
            return [Adapter.of(row) for row in rows]

    def named(self, names: Iterable[str]) -> dict[str, Adapter]:
        """The registered adapters among `names`, by name."""
        wanted = set(names)
        if not wanted:
            return {}
        with self.db.session() as session:
            rows = session.scalars(select(LoraAdapter).where(LoraAdapter.name.in_(wanted)))
            return {row.name: Adapter.of(row) for row in rows}
