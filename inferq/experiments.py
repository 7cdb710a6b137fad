"""`inferq experiments`: the configured A/B experiments and each one's per-variant report."""

from __future__ import annotations

import click

from core.experiments import Estimate, report


@click.group()
def experiments() -> None:
    """A/B experiments (INFERQ_EXPERIMENTS)."""


@experiments.command("list")
def experiments_list() -> None:
    """The configured experiments and their variants' weights."""
    from core.settings import get_settings

    for name, experiment in get_settings().experiments.items():
        weights = ", ".join(f"{v} {variant.weight}" for v, variant in experiment.variants.items())
        click.echo(f"{name}\t{weights}")


@experiments.command("report")
@click.argument("name")
def experiments_report(name: str) -> None:
    """Each variant's ended jobs: users, error rate, TTFT, tokens/s and mean feedback score,
    with 95% confidence intervals."""
    from core.db import Database
    from core.settings import get_settings

    settings = get_settings()
    experiment = settings.experiments.get(name)
    variants = list(experiment.variants) if experiment else []
    rows = report(Database(settings.sqlalchemy_url), name, variants)
    if not any(row.jobs for row in rows):
        raise click.ClickException(f"no ended jobs in experiment {name!r}")
    click.echo(
        f"{'variant':<16}{'jobs':>6}{'users':>7}  {'error rate':<22}{'TTFT s':<24}"
        f"{'tokens/s':<24}feedback"
    )
    for row in rows:
        click.echo(
            f"{row.variant:<16}{row.jobs:>6}{row.users:>7}  {_cell(row.error_rate, '.1%'):<22}"
            f"{_cell(row.ttft_s, '.3f'):<24}{_cell(row.tokens_per_s, '.1f'):<24}"
            f"{_cell(row.feedback, '.2f')} (n={row.feedback.n})"
        )
    click.echo("(means with 95% confidence intervals; error rate: Wilson interval)", err=True)


def _cell(estimate: Estimate, spec: str) -> str:
    if estimate.mean is None:
        return "-"
    if estimate.low is None or estimate.high is None:
        return format(estimate.mean, spec)
    return f"{estimate.mean:{spec}} [{estimate.low:{spec}}, {estimate.high:{spec}}]"
