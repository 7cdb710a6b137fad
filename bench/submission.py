"""Bulk submission: how long a client waits for 5,000 jobs to be accepted (stored and enqueued).

On a local stack with no worker (nothing takes jobs from the queues), for each database:
- a document Q&A batch: one `POST /v1/qa-batches` with a document of `--document-kb` KB and
  `--questions` questions, a new document each round;
- a job batch: one `POST /v1/jobs/batch` with `--questions` short jobs.
Each POST's time is from sending the request to its 202 (every job durably stored and
enqueued by then); the prompt bytes the database holds for the Q&A batch (the jobs' own
prompts plus the stored prefixes) show whether the document was stored once or per question.

Run: `.venv/bin/python bench/submission.py [--model real|tiny --rounds 3 --postgres URL]`.
`--postgres` takes a server URL: a database of the benchmark's own is made there and dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from report import (
    add_model_argument,
    bench_model,
    bench_settings,
    machine_info,
    model_facts,
    model_line,
    running_stack,
    write_report,
)
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

REPO_ROOT = Path(__file__).resolve().parents[1]


def qa_body(questions: int, document_kb: int) -> dict[str, Any]:
    """A new document of about `document_kb` KB and `questions` questions about it."""
    run = uuid.uuid4().hex[:8]
    clauses = []
    while sum(len(c) + 1 for c in clauses) < document_kb * 1024:
        i = len(clauses)
        clauses.append(f"Clause {i} of lease {run}: the tenant pays rent on day {i % 28 + 1}.")
    document = " ".join(clauses)
    asked = [f"When is rent due under clause {i % len(clauses)}? ({i})" for i in range(questions)]
    return {"document": document, "questions": asked, "max_tokens": 32}


def jobs_body(jobs: int) -> dict[str, Any]:
    """`jobs` short jobs."""
    run = uuid.uuid4().hex[:8]
    return {
        "jobs": [{"prompt": f"Job {i} of {run}: say hi.", "max_tokens": 8} for i in range(jobs)]
    }


def _post_s(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[float, str]:
    started = time.perf_counter()
    response = client.post(path, json=body)
    elapsed = time.perf_counter() - started
    if response.status_code != 202:
        raise SystemExit(f"POST {path} answered {response.status_code}: {response.text[:300]}")
    reply = response.json()
    return elapsed, reply.get("id", "")


def stored_prompt_bytes(database_url: str, batch_id: str) -> int:
    """Bytes of prompt text the database holds for the batch: its jobs' and their prefixes'."""
    from core.models import Job, PromptPrefix

    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            own = connection.scalar(
                select(func.sum(func.length(Job.prompt))).where(Job.batch_id == batch_id)
            )
            prefix_ids = select(Job.prompt_prefix_id).where(Job.batch_id == batch_id).distinct()
            shared = connection.scalar(
                select(func.sum(func.length(PromptPrefix.text))).where(
                    PromptPrefix.id.in_(prefix_ids)
                )
            )
    finally:
        engine.dispose()
    return int(own or 0) + int(shared or 0)


def measure(
    url: str, key: str, database_url: str, rounds: int, questions: int, document_kb: int
) -> dict[str, Any]:
    """`rounds` of one Q&A batch and one job batch, on an idle stack."""
    qa_s, jobs_s, stored = [], [], []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as c:
        for _ in range(rounds):
            elapsed, batch_id = _post_s(c, "/v1/qa-batches", qa_body(questions, document_kb))
            qa_s.append(elapsed)
            stored.append(stored_prompt_bytes(database_url, batch_id))
            jobs_s.append(_post_s(c, "/v1/jobs/batch", jobs_body(questions))[0])
    return {
        "qa_batch_s": [round(s, 3) for s in qa_s],
        "job_batch_s": [round(s, 3) for s in jobs_s],
        "qa_batch_median_s": round(statistics.median(qa_s), 3),
        "job_batch_median_s": round(statistics.median(jobs_s), 3),
        "qa_stored_prompt_bytes": stored[-1],
    }


@contextlib.contextmanager
def own_postgres_database(server_url: str) -> Iterator[str]:
    """A fresh database on the PostgreSQL server at `server_url`, dropped afterwards."""
    name = f"inferq_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def save_chart(results: dict[str, dict[str, Any]], questions: int, path: Path) -> None:
    """Bars: median seconds to accept each batch, per database."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    databases = list(results)
    figure, axis = plt.subplots(figsize=(6.5, 3.8))
    width = 0.38
    for offset, (field, label) in enumerate(
        [("qa_batch_median_s", "Q&A batch"), ("job_batch_median_s", "job batch")]
    ):
        xs = [i + (offset - 0.5) * width for i in range(len(databases))]
        axis.bar(xs, [results[d][field] for d in databases], width, label=label)
    axis.set_xticks(range(len(databases)), databases)
    axis.set_ylabel("seconds to 202 (median)")
    axis.set_title(f"{questions:,} jobs in one POST")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """Run on a fresh stack per database; print the table, save chart and JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_argument(parser, default="real")
    parser.add_argument("--questions", type=int, default=5000)
    parser.add_argument("--document-kb", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--postgres", help="a PostgreSQL server URL (default: SQLite only)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)

    from core.apikeys import KeyStore
    from core.db import Database
    from core.tiers import Tier
    from inferq.local import free_port

    machine = machine_info()
    model_dir = bench_model(args.model)
    model = model_facts(model_dir)
    print(
        f"machine : {machine['cpu_count']} CPUs, {machine['cpu_model']}; {machine['vllm']}\n"
        f"{model_line(model)}\n"
        f"workload: {args.questions} questions over a {args.document_kb} KB document in one "
        f"POST /v1/qa-batches; {args.questions} short jobs in one POST /v1/jobs/batch; "
        f"{args.rounds} rounds\n",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    databases = ["sqlite"] + (["postgresql"] if args.postgres else [])
    for database in databases:
        work_dir = Path(tempfile.mkdtemp(prefix="inferq-bench-"))
        with contextlib.ExitStack() as stack:
            url = (
                stack.enter_context(own_postgres_database(args.postgres))
                if database != "sqlite"
                else None
            )
            settings = bench_settings(work_dir, model_dir, url)
            with running_stack(settings, free_port(), worker=False) as (api_url, _, _):
                key = KeyStore(Database(settings.sqlalchemy_url)).create("bench", Tier.BASIC)[0]
                results[database] = measure(
                    api_url,
                    key,
                    settings.sqlalchemy_url,
                    args.rounds,
                    args.questions,
                    args.document_kb,
                )
        shutil.rmtree(work_dir, ignore_errors=True)

    print(f"{'database':<12}{'Q&A batch s':>13}{'job batch s':>13}{'Q&A prompt bytes':>18}")
    for database, r in results.items():
        print(
            f"{database:<12}{r['qa_batch_median_s']:>13.3f}{r['job_batch_median_s']:>13.3f}"
            f"{r['qa_stored_prompt_bytes']:>18,}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    chart = args.out / "submission.png"
    save_chart(results, args.questions, chart)
    workload = vars(args) | {"out": str(args.out), "postgres": bool(args.postgres)}
    write_report(args.out / "submission.json", chart, machine, model, workload, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
