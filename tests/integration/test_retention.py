"""Nothing piles up: every per-job Redis key expires, and old finished rows are purged."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from core import keys
from core.apikeys import Quota
from core.files import new_stored_file
from core.models import Batch, Job, PromptPrefix, StoredFile, utcnow
from core.prompts import text_digest
from core.tiers import Tier
from scheduler.retention import Retention, retention_cutoff
from tests.support import BLOCKER_TOKENS, Stack, read_sse, wait_final, worker_paused

# kombu's own bookkeeping in the broker: exchange bindings (`_kombu.binding.*`,
# `_kombu.binding_permanent.*`, `_kombu.binding_deadlines`) and the unacknowledged-message
# index. They live as long as the broker is in use, whatever the jobs.
KOMBU_LONG_LIVED = re.compile(r"^(_kombu\.binding[._].*|unacked|unacked_index)$")


def _long_lived_keys(stack: Stack) -> tuple[set[str], tuple[str, ...]]:
    """Keys that may live without a TTL (exact names, name prefixes), all from core/keys.py.

    The tier queues (shared and each worker's own) and their wake-up lists, the fair-share state
    (held lists, owners, counters, parked sets), the worker registry and the scheduler's
    data mark: shared state, not per job.
    """
    workers = {m.decode() for m in stack.redis.smembers(keys.WORKERS_SET)} | {stack.worker_name}
    exact = {keys.WORKERS_SET, keys.DATA_MARK}
    prefixes = []
    for tier in Tier:
        exact |= {
            keys.queue_name(tier),
            keys.held_count(tier),
            keys.held_owners(tier),
            keys.held_round(tier),
            keys.dispatching(tier),
        }
        exact |= {keys.worker_queue_name(tier, worker) for worker in workers}
        queues = {keys.queue_name(tier)} | {keys.worker_queue_name(tier, w) for w in workers}
        exact |= {keys.queue_wake(queue) for queue in queues}  # a queue's tokens, at most 16
        prefixes.append(keys.held_list(tier, ""))  # one list per owner with held jobs
    return exact, tuple(prefixes)


def _keys_without_ttl(stack: Stack) -> dict[str, str]:
    """Every key in the stack's Redis that has no TTL, with its type."""
    names = list(stack.redis.scan_iter(count=1000))
    pipe = stack.redis.pipeline(transaction=False)
    for name in names:
        pipe.ttl(name)
        pipe.type(name)
    replies = pipe.execute()
    found = {}
    for index, name in enumerate(names):
        ttl, kind = replies[2 * index], replies[2 * index + 1]
        if ttl == -1:
            found[name.decode()] = kind.decode()
    return found


def test_every_per_job_key_expires_after_jobs_of_every_kind_end(stack: Stack) -> None:
    # A key with quotas, so the per-job quota bookkeeping is exercised too.
    key = stack.create_key(Tier.PREMIUM, quota=Quota(requests_per_minute=1000, max_concurrent=50))
    jobs: dict[str, dict[str, Any]] = {}
    with stack.client(key) as client:
        # Deterministic, so its result goes to the result cache; then a repeat served from it.
        prompt = f"Retention {uuid.uuid4().hex}: what stays in Redis?"
        first = stack.submit(key, prompt=prompt, max_tokens=8, temperature=0)
        jobs["plain"] = wait_final(client, first["id"])
        jobs["cached"] = stack.submit(key, prompt=prompt, max_tokens=8, temperature=0)
        assert jobs["cached"]["served_from"] == "cache"

        streamed = stack.submit(key, prompt="Stream me.", max_tokens=16, ignore_eos=True)
        events = read_sse(client, streamed["id"])
        assert events[-1]["type"] == "done"
        jobs["streamed"] = wait_final(client, streamed["id"])

        batch = client.post(
            "/v1/jobs/batch",
            json={"jobs": [{"prompt": f"Batch {i}.", "max_tokens": 4} for i in range(3)]},
        )
        assert batch.status_code == 202, batch.text
        for index, job in enumerate(batch.json()["data"]):
            jobs[f"batch-{index}"] = wait_final(client, job["id"])

        # Cancelled while running: aborted in the engine mid-generation.
        running = stack.submit(
            key, prompt="Run, then stop.", max_tokens=BLOCKER_TOKENS, ignore_eos=True
        )
        read_sse(client, running["id"], until=lambda event: event["type"] == "delta")
        assert client.delete(f"/v1/jobs/{running['id']}").status_code in (200, 202)
        jobs["cancelled-running"] = wait_final(client, running["id"])

        # Cancelled while queued: it never reaches the worker.
        with worker_paused(stack):
            queued = stack.submit(key, prompt="Never run.", max_tokens=4)
            cancelled = client.delete(f"/v1/jobs/{queued['id']}")
            assert cancelled.status_code == 200, cancelled.text
        jobs["cancelled-queued"] = wait_final(client, queued["id"])

    assert jobs["cancelled-running"]["status"] == "cancelled"
    assert jobs["cancelled-queued"]["status"] == "cancelled"
    assert all(job["status"] in ("succeeded", "cancelled") for job in jobs.values()), jobs
    stack.wait_idle()

    # The per-job keys these jobs left do exist, each with a TTL no longer than the setting.
    ttl_limit = stack.local.settings.job_key_ttl_s
    for name, job in jobs.items():
        ttl = stack.redis.ttl(keys.job_event_stream(job["id"]))
        assert 0 < ttl <= ttl_limit, (name, ttl)
    for name in ("cancelled-running", "cancelled-queued"):
        ttl = stack.redis.ttl(keys.job_cancel_flag(jobs[name]["id"]))
        assert 0 < ttl <= ttl_limit, (name, ttl)

    # Every key without a TTL is a named long-lived one.
    exact, prefixes = _long_lived_keys(stack)
    unexpected = {
        name: kind
        for name, kind in _keys_without_ttl(stack).items()
        if name not in exact and not name.startswith(prefixes) and not KOMBU_LONG_LIVED.match(name)
    }
    assert unexpected == {}, f"keys without a TTL: {unexpected}"


def _job(
    owner: str,
    status: str,
    created: datetime,
    finished: datetime | None,
    batch_id: str | None = None,
) -> Job:
    return Job(
        id=f"job_{uuid.uuid4().hex}",
        owner=owner,
        tier="standard",
        status=status,
        prompt="old",
        sampling_params={"max_tokens": 4},
        timeout_s=60,
        created_at=created,
        finished_at=finished,
        batch_id=batch_id,
    )


def _prefix(created: datetime) -> PromptPrefix:
    text = f"A document of its own: {uuid.uuid4().hex}"
    return PromptPrefix(id=text_digest(text), text=text, tokens=len(text), created_at=created)


def _batch(
    owner: str, kind: str, status: str, created: datetime, finished: datetime | None
) -> Batch:
    return Batch(
        id=f"b_{uuid.uuid4().hex}",
        kind=kind,
        owner=owner,
        tier="standard",
        status=status,
        created_at=created,
        finished_at=finished,
    )


def _left(stack: Stack, owner: str, prefixes: list[str]) -> set[str]:
    """The ids of the owner's jobs, batches and files, and of `prefixes`, still stored."""
    with stack.db.session() as session:
        left = set(session.scalars(select(Job.id).where(Job.owner == owner)))
        left |= set(session.scalars(select(Batch.id).where(Batch.owner == owner)))
        left |= set(session.scalars(select(StoredFile.id).where(StoredFile.owner == owner)))
        left |= set(session.scalars(select(PromptPrefix.id).where(PromptPrefix.id.in_(prefixes))))
    return left


def test_retention_deletes_old_finished_jobs_and_batches_and_keeps_the_rest(
    stack: Stack,
) -> None:
    owner = f"retention-{uuid.uuid4().hex[:8]}"
    now = utcnow()
    old = now - timedelta(days=40)
    old_end = now - timedelta(days=35)
    recent_end = now - timedelta(days=1)
    rows: list[Any] = []
    gone: set[str] = set()
    kept: set[str] = set()

    def add(row: Any, goes: bool) -> Any:
        rows.append(row)
        (gone if goes else kept).add(row.id)
        return row

    # Jobs of no batch: finished before the cutoff go, in every final state.
    for status in ("succeeded", "failed", "cancelled", "timed_out"):
        add(_job(owner, status, old, old_end), goes=True)
    add(_job(owner, "queued", old, None), goes=False)  # unfinished, however old
    add(_job(owner, "running", old, None), goes=False)
    add(_job(owner, "succeeded", old, recent_end), goes=False)  # old, but finished recently
    add(_job(owner, "succeeded", recent_end, recent_end), goes=False)

    # A finished Q&A batch: it goes with all its jobs, and the document they stored once.
    qa = add(_batch(owner, "qa", "completed", old, old_end), goes=True)
    document = add(_prefix(old), goes=True)
    for _ in range(5):
        add(_job(owner, "succeeded", old, old_end, qa.id), goes=True).prompt_prefix_id = document.id
    # A finished OpenAI batch: with its jobs and the files inferq wrote; the upload stays.
    upload = add(new_stored_file(owner, "batch", "in.jsonl", b"{}\n", old), goes=False)
    output = add(new_stored_file(owner, "batch_output", "out.jsonl", b"{}\n", old), goes=True)
    errors = add(new_stored_file(owner, "batch_output", "err.jsonl", b"{}\n", old), goes=True)
    openai = add(_batch(owner, "openai", "completed", old, old_end), goes=True)
    openai.input_file_id, openai.output_file_id, openai.error_file_id = (
        upload.id,
        output.id,
        errors.id,
    )
    for status in ("succeeded", "failed"):
        add(_job(owner, status, old, old_end, openai.id), goes=True)
    # Old batches that are not done with: one job still queued; one job finished recently.
    waiting = add(_batch(owner, "qa", "in_progress", old, None), goes=False)
    still_read = add(_prefix(old), goes=False)
    add(_job(owner, "succeeded", old, old_end, waiting.id), goes=False)
    add(_job(owner, "queued", old, None, waiting.id), goes=False).prompt_prefix_id = still_read.id
    late = add(_batch(owner, "qa", "in_progress", old, None), goes=False)
    add(_job(owner, "succeeded", old, old_end, late.id), goes=False)
    add(_job(owner, "cancelled", old, recent_end, late.id), goes=False)

    with stack.db.session() as session:
        session.add_all([row for row in rows if isinstance(row, PromptPrefix)])
        session.flush()  # before the jobs that name them
        session.add_all([row for row in rows if not isinstance(row, PromptPrefix)])

    # Small chunks, so deleting takes several transactions.
    report = Retention(stack.db, chunk=2).purge(retention_cutoff(30))

    prefixes = [document.id, still_read.id]
    left = _left(stack, owner, prefixes)
    assert left == kept
    assert not left & gone
    assert report.jobs >= 11 and report.batches >= 2 and report.files >= 2
    assert report.prefixes >= 1

    # `inferq db purge` does the same from the command line; nothing recent is touched.
    late_job = _job(owner, "succeeded", old, old_end)
    with stack.db.session() as session:
        session.add(late_job)
    result = subprocess.run(
        [sys.executable, "-m", "inferq", "db", "purge", "--older-than", "30"],
        env=stack.local.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    deleted = r"deleted \d+ jobs, \d+ batches, \d+ files and \d+ prompt prefixes"
    assert re.search(deleted, result.stdout), result.stdout
    with stack.db.session() as session:
        assert session.get(Job, late_job.id) is None
    assert _left(stack, owner, prefixes) == kept
