"""`inferq adapters`: register, list and remove the LoRA adapters jobs may name as their model.

The registry is the database (`core.adapters`): what is added here is seen by the API and
every worker at once, while they run. Workers serve adapters with `INFERQ_LORA=true`.
"""

from __future__ import annotations

from pathlib import Path

import click

from core.adapters import AdapterStore
from core.errors import ClientError


def _store() -> AdapterStore:
    from core.db import Database
    from core.settings import get_settings

    return AdapterStore(Database(get_settings().sqlalchemy_url))


@click.group()
def adapters() -> None:
    """LoRA adapters of the served model."""


@adapters.command("add")
@click.argument("name")
@click.argument("path", type=click.Path(path_type=Path, file_okay=False, exists=True))
def adapters_add(name: str, path: Path) -> None:
    """Register the adapter in PATH (a PEFT LoRA directory) as NAME.

    The workers load it from PATH on its first job, so PATH must be readable there too.
    """
    from core.settings import get_settings

    settings = get_settings()
    try:
        adapter = _store().add(name, path.resolve(), max_rank=settings.lora_max_rank)
    except ClientError as exc:
        raise click.ClickException(exc.message) from exc
    click.echo(f"added {adapter.name} (id {adapter.id}, rank {adapter.rank}): {adapter.path}")
    if not settings.lora:
        click.echo("note: INFERQ_LORA is off here; jobs may name it once the stack serves adapters")


@adapters.command("list")
def adapters_list() -> None:
    """List the registered adapters."""
    for adapter in _store().all():
        click.echo(f"{adapter.id}\t{adapter.name}\trank {adapter.rank}\t{adapter.path}")


@adapters.command("remove")
@click.argument("name")
def adapters_remove(name: str) -> None:
    """Unregister NAME: new jobs may no longer name it; queued ones fail when they start."""
    if not _store().remove(name):
        raise click.ClickException(f"no adapter named {name!r}")
    click.echo(f"removed {name}")


@adapters.command("demo")
@click.argument("directory", type=click.Path(path_type=Path, file_okay=False))
def adapters_demo(directory: Path) -> None:
    """Write a demo adapter of the tiny model (random weights) into DIRECTORY."""
    from workers.tiny_model import init_tiny_adapter

    click.echo(init_tiny_adapter(directory))
