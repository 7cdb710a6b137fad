"""Every Redis key, channel and queue name inferq uses, built in one place."""

from __future__ import annotations

from core.tiers import Tier

PREFIX = "inferq"


# Celery's Redis transport stores a queue as a list under the queue's name.
def queue_name(tier: Tier | str) -> str:
    """The Celery queue of one tier, e.g. `inferq.premium`."""
    return f"{PREFIX}.{Tier(tier).value}"


def tier_of_queue(name: str) -> Tier | None:
    """The tier of a shared or a worker's own queue (`inferq.basic`, `inferq.basic.cpu@host`)."""
    prefix = f"{PREFIX}."
    if not name.startswith(prefix):
        return None
    try:
        return Tier(name[len(prefix) :].split(".", 1)[0])
    except ValueError:
        return None


def worker_queue_name(tier: Tier | str, worker_name: str) -> str:
    """A worker's own queue of one tier, for jobs routed to it by prompt prefix.

    The scheduler's reclaim script builds the same name (`{queue}.{worker}`) in Lua.
    """
    return f"{queue_name(tier)}.{worker_name}"


def job_events_channel(job_id: str) -> str:
    """Pub/sub channel carrying a job's live events."""
    return f"{PREFIX}:job:{job_id}:events"


def job_event_stream(job_id: str) -> str:
    """Redis stream keeping a job's events for late or reconnecting readers."""
    return f"{PREFIX}:job:{job_id}:stream"


def job_final_stream(job_id: str) -> str:
    """Redis stream holding only a job's final event: what long polls block on."""
    return f"{PREFIX}:job:{job_id}:final"


def job_cancel_flag(job_id: str) -> str:
    """Set when a cancel was asked for, so a worker that is about to start the job sees it."""
    return f"{PREFIX}:job:{job_id}:cancel"


def job_watched(job_id: str) -> str:
    """Set when a reader follows a job's stream: its worker then publishes every delta live."""
    return f"{PREFIX}:job:{job_id}:watched"


def job_lease(job_id: str) -> str:
    """The claim of the worker running a job; renewed while it runs, lapses if it dies."""
    return f"{PREFIX}:job:{job_id}:lease"


def job_quota_set(job_id: str) -> str:
    """Names the concurrency set of the key a job counts against (cleared by its final event)."""
    return f"{PREFIX}:job:{job_id}:quota"


def key_rate(key_id: int, kind: str) -> str:
    """A key's rate-limit state (`requests` or `tokens`): its theoretical arrival time."""
    return f"{PREFIX}:key:{key_id}:rate:{kind}"


def key_active(key_id: int) -> str:
    """Sorted set of a key's unfinished jobs, scored by deadline."""
    return f"{PREFIX}:key:{key_id}:active"


def held_list(tier: Tier | str, owner: str) -> str:
    """One owner's jobs held back from a full tier queue (`core.queue.dispatch`)."""
    return f"{PREFIX}:held:{Tier(tier).value}:list:{owner}"


def held_owners(tier: Tier | str) -> str:
    """Sorted set of owners with held jobs in a tier, least recently served first."""
    return f"{PREFIX}:held:{Tier(tier).value}:owners"


def held_count(tier: Tier | str) -> str:
    """How many jobs of a tier are held back."""
    return f"{PREFIX}:held:{Tier(tier).value}:count"


def held_round(tier: Tier | str) -> str:
    """The round-robin counter of a tier's held owners."""
    return f"{PREFIX}:held:{Tier(tier).value}:round"


def sending_count(tier: Tier | str) -> str:
    """Messages the API decided to put on a tier's queue and may not have sent yet."""
    return f"{PREFIX}:held:{Tier(tier).value}:sending"


def dispatching(tier: Tier | str) -> str:
    """Jobs taken from held lists whose message may not be sent yet."""
    return f"{PREFIX}:dispatching:{Tier(tier).value}"


def finished_bucket(bucket: int) -> str:
    """Jobs that ended in one 10-second bucket (Unix time // 10), counted by the workers."""
    return f"{PREFIX}:finished:{bucket}"


def started_tier_bucket(tier: Tier | str, bucket: int) -> str:
    """Jobs of one tier that started in one 10-second bucket, counted by the workers."""
    return f"{PREFIX}:started:{Tier(tier).value}:{bucket}"


def finished_tier_bucket(tier: Tier | str, bucket: int) -> str:
    """Runs of one tier's jobs that ended in one 10-second bucket, counted by the workers."""
    return f"{PREFIX}:finished:{Tier(tier).value}:{bucket}"


def run_ms_bucket(tier: Tier | str, bucket: int) -> str:
    """Milliseconds the runs counted by `finished_tier_bucket` took together."""
    return f"{PREFIX}:run-ms:{Tier(tier).value}:{bucket}"


RATE_BUCKET_S = 10
"""The width of the workers' rate buckets (`finished_bucket` and the per-tier ones)."""
RATE_BUCKET_TTL_S = 120


def result_cache(digest: str) -> str:
    """A deterministic request's cached result (see `core.resultcache`)."""
    return f"{PREFIX}:cache:{digest}"


DISPATCH_WAKE = f"{PREFIX}:dispatch:wake"
"""At most one token, pushed when a job is held: it wakes an idle dispatcher (60 s TTL)."""

WATCH_CHANNEL = f"{PREFIX}:watch"
"""Workers listen here for ids of jobs a reader has started to follow (see `job_watched`)."""

FINAL_EVENTS_CHANNEL = f"{PREFIX}:final-events"
"""Every job's final event is announced here as the bare job id (see `api.final_events`)."""

CANCEL_CHANNEL = f"{PREFIX}:cancel"
"""Workers listen here for ids of running jobs to abort."""


def worker_stats(worker_name: str) -> str:
    """Hash of a worker's counters (in flight, peak, engine requests)."""
    return f"{PREFIX}:worker:{worker_name}:stats"


def worker_serves(worker_name: str) -> str:
    """What a worker serves (`core.workerinfo.Serving`), set by its heartbeat with its stats."""
    return f"{PREFIX}:worker:{worker_name}:serves"


def worker_room_field(tier: Tier | str) -> str:
    """The field of `worker_stats` with how many more jobs of a tier the worker would take."""
    return f"room_{Tier(tier).value}"


def worker_takes_field(tier: Tier | str) -> str:
    """The field of `worker_stats` that says (1 or 0) whether the worker takes a tier's jobs."""
    return f"takes_{Tier(tier).value}"


def worker_name_claim(worker_name: str) -> str:
    """Held by the one live process that goes by a worker name (see `core.workernames`)."""
    return f"{PREFIX}:worker-name:{worker_name}"


WORKERS_SET = f"{PREFIX}:workers"
"""Names of workers that have started."""

DATA_MARK = f"{PREFIX}:data-mark"
"""Never expires: its absence tells the scheduler that Redis lost its data (see `reaper`)."""
