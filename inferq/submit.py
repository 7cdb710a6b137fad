"""`inferq submit`: ask the model something and print its answer as it is written.

Like `ollama run` or `llm`, it talks to an instruct model through the model's chat template
(`--system` adds a system prompt; `--raw` sends the text as a plain completion prompt instead).
The answer goes to stdout as it streams in, and nothing else does: progress and the job's id
go to stderr. Ctrl-C drops the stream, which cancels the job.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

import click
import httpx

from inferq.client import ApiError, InferqClient

TEMPERATURE = 0.0
"""Deterministic answers unless asked otherwise: a person asking a question expects the same
answer twice, and a small model strays quickly when it samples."""


def request_body(
    text: str, *, system: str | None, raw: bool, max_tokens: int | None, temperature: float
) -> dict[str, Any]:
    """The job to submit: the text as a chat turn (or as a plain prompt with `raw`)."""
    body: dict[str, Any] = {"temperature": temperature}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if raw:
        if system is not None:
            raise click.UsageError("--system needs the chat template; it cannot go with --raw")
        return {"prompt": text, **body}
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": text})
    return {"messages": messages, **body}


class AnswerPrinter:
    """Writes a job's text to stdout as its deltas arrive, and its progress to stderr."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out, self.err = out, err
        self.printed = ""
        self.attempt = 1
        self.job: dict[str, Any] | None = None

    def status(self, line: str) -> None:
        """A progress line; on a terminal it is rewritten in place until the text begins."""
        if self.err.isatty() and not self.printed:
            self.err.write(f"\r\033[K{line}")
            self.err.flush()

    def event(self, event: dict[str, Any]) -> None:
        """Take one of the job's events."""
        kind = event["type"]
        if kind == "status":
            attempt = int(event.get("attempt") or self.attempt)
            if attempt > self.attempt and self.printed:
                self.err.write(f"\n[the worker was lost; the job started again, run {attempt}]\n")
                self.out.write("\n")
                self.printed = ""
            self.attempt = max(self.attempt, attempt)
            self.status(f"{event['job_id']} {event.get('status', '')} …")
        elif kind == "delta" and event.get("text"):
            self.status("")  # the text begins: the progress line goes
            self.out.write(event["text"])
            self.out.flush()
            self.printed += event["text"]

    def finish(self, job: dict[str, Any]) -> None:
        """The job has ended: print what the stream missed, then the newline."""
        self.status("")
        text = job.get("text") or ""
        if text.startswith(self.printed):
            self.out.write(text[len(self.printed) :])
        elif text:  # the stream broke off in a run that was later replaced
            self.out.write("\n" + text)
        self.out.write("\n")
        self.out.flush()
        tokens = (job.get("usage") or {}).get("completion_tokens") or 0
        seconds = (job.get("timings") or {}).get("total_s") or 0.0
        self.err.write(f"{job['id']} {job['status']} · {tokens} tokens · {seconds:.2f} s\n")


def ask(client: InferqClient, body: dict[str, Any], printer: AnswerPrinter) -> dict[str, Any]:
    """Submit `body`, print its answer as it streams; the job as it ended."""
    job_id = None
    try:
        for event in client.submit_and_follow(body):
            job_id = event["job_id"]
            printer.event(event)
    except httpx.TransportError:
        if job_id is None:
            raise
        printer.err.write("\n[the stream broke off; waiting for the job to end]\n")
    if job_id is None:
        raise click.ClickException("the API sent no event for the job")
    job = client.wait(job_id, show_progress=False)
    printer.finish(job)
    return job


@click.command()
@click.argument("prompt", required=False)
@click.option("--file", "prompt_file", type=click.File("r"), help="Read the prompt from a file.")
@click.option("--system", default=None, help="A system prompt (the model's chat template).")
@click.option("--raw", is_flag=True, help="A plain completion prompt, without the chat template.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None)
@click.option("--temperature", type=click.FloatRange(0, 2), default=TEMPERATURE, show_default=True)
@click.option("--api-url", envvar="INFERQ_API_URL", default="http://127.0.0.1:8000")
@click.option("--key", envvar="INFERQ_API_KEY", default=None, help="Default: the dev key of up.")
def submit(
    prompt: str | None,
    prompt_file: TextIO | None,
    system: str | None,
    raw: bool,
    max_tokens: int | None,
    temperature: float,
    api_url: str,
    key: str | None,
) -> None:
    """Ask the model PROMPT (or --file's text) and print the answer as it is written."""
    from core.settings import get_settings
    from inferq.local import read_dev_key

    text = prompt_file.read() if prompt_file is not None else prompt
    if not text:
        raise click.UsageError("give a PROMPT or --file")
    body = request_body(
        text, system=system, raw=raw, max_tokens=max_tokens, temperature=temperature
    )
    key = key or read_dev_key(get_settings().data_dir)
    if key is None:
        raise click.UsageError("no key: pass --key, set INFERQ_API_KEY, or run `inferq up`")
    printer = AnswerPrinter(sys.stdout, sys.stderr)
    try:
        job = ask(InferqClient(api_url, key), body, printer)
    except ApiError as exc:
        raise click.ClickException(str(exc)) from exc
    except httpx.TransportError as exc:
        raise click.ClickException(f"cannot reach the API at {api_url}: {exc}") from exc
    if job["status"] != "succeeded":
        error = job.get("error") or {}
        raise click.ClickException(f"job {job['id']} {job['status']}: {error.get('message', '')}")
