"""`inferq batch`: submit a document Q&A batch, follow it with a progress bar, save answers.

`submit` prints the batch id first, so an interrupted wait can be resumed with `wait ID`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from inferq.client import ApiError, InferqClient

POLL_S = 1.0


def _client(api_url: str, key: str | None) -> InferqClient:
    from core.settings import Settings
    from inferq.local import read_dev_key

    key = key or read_dev_key(Settings().data_dir)
    if key is None:
        raise click.UsageError("no key: pass --key, set INFERQ_API_KEY, or run `inferq up`")
    return InferqClient(api_url, key)


def _call(response: Any) -> dict[str, Any]:
    body: dict[str, Any] = response.json()
    if response.status_code >= 400:
        raise click.ClickException(str(ApiError(response.status_code, body)))
    return body


def _progress(batch: dict[str, Any]) -> str:
    counts = batch["counts"]
    done = sum(counts[s] for s in ("succeeded", "failed", "cancelled", "timed_out"))
    total = batch["total"] or 1
    width = 30
    filled = width * done // total
    return (
        f"\r{batch['id']} [{'#' * filled}{'.' * (width - filled)}] {done}/{batch['total']} "
        f"running {counts['running']}, failed {counts['failed'] + counts['timed_out']}  "
    )


def wait_and_save(client: InferqClient, batch_id: str, output: Path, fmt: str) -> dict[str, Any]:
    """Poll the batch until it has ended, showing progress on stderr; write its results."""
    while True:
        batch = _call(client.http.get(f"/v1/qa-batches/{batch_id}", params={"answers": "false"}))
        if sys.stderr.isatty():
            sys.stderr.write(_progress(batch))
            sys.stderr.flush()
        if batch["status"] in ("completed", "cancelled"):
            break
        time.sleep(POLL_S)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    response = client.http.get(f"/v1/qa-batches/{batch_id}/results", params={"format": fmt})
    if response.status_code >= 400:
        _call(response)
    output.write_bytes(response.content)
    counts = batch["counts"]
    click.echo(
        f"{batch_id} {batch['status']}: {counts['succeeded']} answered, "
        f"{counts['failed'] + counts['timed_out']} failed, {counts['cancelled']} cancelled; "
        f"answers in {output}",
        err=True,
    )
    return batch


def _format_of(output: Path) -> str:
    return "csv" if output.suffix.lower() == ".csv" else "jsonl"


@click.group()
def batch() -> None:
    """Document Q&A batches: one document, many questions."""


_api_url = click.option("--api-url", envvar="INFERQ_API_URL", default="http://127.0.0.1:8000")
_key = click.option("--key", envvar="INFERQ_API_KEY", default=None, help="Default: up's dev key.")
_output = click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Where the answers go: .csv for CSV, anything else JSON Lines.",
)


@batch.command("submit")
@click.argument("document", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("questions", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_output
@click.option("--max-tokens", type=int, default=None)
@click.option("--temperature", type=float, default=None)
@click.option("--template", default=None, help="Prompt template with {document} and {question}.")
@click.option("--no-wait", is_flag=True, help="Print the batch id and return.")
@_api_url
@_key
def batch_submit(
    document: Path,
    questions: Path,
    output: Path,
    max_tokens: int | None,
    temperature: float | None,
    template: str | None,
    no_wait: bool,
    api_url: str,
    key: str | None,
) -> None:
    """Ask every line of QUESTIONS about DOCUMENT; wait, then write the answers."""
    asked = [line.strip() for line in questions.read_text().splitlines() if line.strip()]
    if not asked:
        raise click.UsageError(f"{questions} has no questions (one per line)")
    body: dict[str, Any] = {"document": document.read_text(), "questions": asked}
    optional = {"max_tokens": max_tokens, "temperature": temperature, "prompt_template": template}
    body.update({name: value for name, value in optional.items() if value is not None})
    client = _client(api_url, key)
    created = _call(client.http.post("/v1/qa-batches", json=body))
    click.echo(created["id"])
    click.echo(f"resume with: inferq batch wait {created['id']} -o {output}", err=True)
    if not no_wait:
        wait_and_save(client, created["id"], output, _format_of(output))


@batch.command("wait")
@click.argument("batch_id")
@_output
@_api_url
@_key
def batch_wait(batch_id: str, output: Path, api_url: str, key: str | None) -> None:
    """Follow a batch until it has ended, then write its answers."""
    wait_and_save(_client(api_url, key), batch_id, output, _format_of(output))


@batch.command("cancel")
@click.argument("batch_id")
@_api_url
@_key
def batch_cancel(batch_id: str, api_url: str, key: str | None) -> None:
    """Cancel every question of a batch not answered yet."""
    batch = _call(_client(api_url, key).http.post(f"/v1/qa-batches/{batch_id}/cancel"))
    click.echo(f"{batch_id} {batch['status']}")
