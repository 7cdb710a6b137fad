"""`inferq keys`: create, list and revoke API keys."""

from __future__ import annotations

import click

from core.settings import get_settings
from core.tiers import Tier


@click.group()
def keys() -> None:
    """API keys."""


@keys.command("create")
@click.option("--owner", required=True)
@click.option("--tier", type=click.Choice([t.value for t in Tier]), default=Tier.STANDARD.value)
@click.option("--rpm", type=click.IntRange(min=1), default=None, help="Jobs per minute.")
@click.option("--tpm", type=click.IntRange(min=1), default=None, help="Tokens per minute.")
@click.option(
    "--max-concurrent", type=click.IntRange(min=1), default=None, help="Unfinished jobs at once."
)
def keys_create(
    owner: str, tier: str, rpm: int | None, tpm: int | None, max_concurrent: int | None
) -> None:
    """Create a key; it is printed once and only its hash is stored."""
    from core.apikeys import KeyStore, Quota
    from core.db import Database

    quota = Quota(rpm, tpm, max_concurrent)
    key, record = KeyStore(Database(get_settings().sqlalchemy_url)).create(owner, Tier(tier), quota)
    click.echo(key)
    click.echo(f"(id {record.id}, owner {owner}, tier {tier}; shown once)", err=True)


@keys.command("list")
@click.option("--owner", default=None)
def keys_list(owner: str | None) -> None:
    """List keys (never the keys themselves)."""
    from core.apikeys import KeyStore
    from core.db import Database

    for record in KeyStore(Database(get_settings().sqlalchemy_url)).list(owner):
        state = "revoked" if record.revoked_at else "active"
        limits = ", ".join(
            f"{value} {name}"
            for name, value in (
                ("rpm", record.requests_per_minute),
                ("tpm", record.tokens_per_minute),
                ("concurrent", record.max_concurrent),
            )
            if value is not None
        )
        click.echo(
            f"{record.id}\t{record.prefix}…\t{record.owner}\t{record.tier}\t{state}"
            f"\t{limits or 'no limits'}"
        )


@keys.command("revoke")
@click.argument("key_id", type=int)
def keys_revoke(key_id: int) -> None:
    """Revoke a key by id."""
    from core.apikeys import KeyStore
    from core.db import Database

    if not KeyStore(Database(get_settings().sqlalchemy_url)).revoke(key_id):
        raise click.ClickException(f"no active key with id {key_id}")
    click.echo(f"revoked {key_id}")
