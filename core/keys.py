"""Every Redis key, channel and queue name inferq uses, built in one place."""

from __future__ import annotations

from core.tiers import Tier

PREFIX = "inferq"


# Celery's Redis transport stores a queue as a list under the queue's name.
def queue_name(tier: Tier | str, lane: str | None = None) -> str:
    """The Celery queue of one tier, e.g. `inferq.premium`; with `lane`, that tier's queue for
    the jobs of one more model (`core.settings.Settings.models`), `inferq.premium.model.{lane}`.

    The scheduler's reclaim script builds the lane's name (`{queue}.model.{lane}`) in Lua.
    """
    name = f"{PREFIX}.{Tier(tier).value}"
    return name if lane is None else f"{name}.model.{lane}"


def tier_of_queue(name: str) -> Tier | None:
    """The tier of a shared, a lane's or a worker's own queue (`inferq.basic`,
    `inferq.basic.model.m`, `inferq.basic.cpu@host`)."""
    prefix = f"{PREFIX}."
    if not name.startswith(prefix):
        return None
    try:
        return Tier(name[len(prefix) :].split(".", 1)[0])
    except ValueError:
        return None


def worker_queue_name(tier: Tier | str, worker_name: str) -> str:
    """A worker's own queue of one tier, for jobs routed to it by prompt prefix.

    A worker serves one model, so its own queues need no lane. The scheduler's reclaim script
    builds the same name (`{queue}.{worker}`) in Lua.
    """
    return f"{queue_name(tier)}.{worker_name}"


def queue_wake(queue: str) -> str:
    """The wake-up list of a queue: tokens that tell a waiting worker it has messages
    (`core.queue.wake`). The scripts that put messages on queues build the same name in Lua."""
    return f"{PREFIX}:wake:{queue}"


def job_events_channel(job_id: str) -> str:
    """Pub/sub channel carrying a job's live events."""
    return f"{PREFIX}:job:{job_id}:events"


def job_event_stream(job_id: str) -> str:
    """Redis stream keeping a job's events for late or reconnecting readers."""
    return f"{PREFIX}:job:{job_id}:stream"


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


def _tier_lane(tier: Tier | str, lane: str | None) -> str:
    """A tier, or a tier of one lane (see `queue_name`), in the dispatcher's keys."""
    return Tier(tier).value if lane is None else f"{Tier(tier).value}@{lane}"


def held_list(tier: Tier | str, owner: str, lane: str | None = None) -> str:
    """One owner's jobs held back from a full tier queue (`core.queue.dispatch`)."""
    return f"{PREFIX}:held:{_tier_lane(tier, lane)}:list:{owner}"


def held_owners(tier: Tier | str, lane: str | None = None) -> str:
    """Sorted set of owners with held jobs in a tier, least recently served first."""
    return f"{PREFIX}:held:{_tier_lane(tier, lane)}:owners"


def held_count(tier: Tier | str, lane: str | None = None) -> str:
    """How many jobs of a tier are held back."""
    return f"{PREFIX}:held:{_tier_lane(tier, lane)}:count"


def held_round(tier: Tier | str, lane: str | None = None) -> str:
    """The round-robin counter of a tier's held owners."""
    return f"{PREFIX}:held:{_tier_lane(tier, lane)}:round"


def sending_count(tier: Tier | str, lane: str | None = None) -> str:
    """Messages the API decided to put on a tier's queue and may not have sent yet."""
    return f"{PREFIX}:held:{_tier_lane(tier, lane)}:sending"


def dispatching(tier: Tier | str, lane: str | None = None) -> str:
    """Jobs taken from held lists whose message may not be sent yet (a set)."""
    return f"{PREFIX}:parked:{_tier_lane(tier, lane)}"


def dispatching_list(tier: Tier | str, lane: str | None = None) -> str:
    """Where dispatchers before the set parked jobs (a list), read once by a new one."""
    return f"{PREFIX}:dispatching:{_tier_lane(tier, lane)}"


def finished_bucket(bucket: int, lane: str | None = None) -> str:
    """Jobs of a lane that ended in one 10-second bucket (Unix time // 10), counted by the
    workers."""
    return f"{PREFIX}:finished:{bucket}" if lane is None else f"{PREFIX}:finished:@{lane}:{bucket}"


def started_tier_bucket(tier: Tier | str, bucket: int, lane: str | None = None) -> str:
    """Jobs of one tier of a lane that started in one 10-second bucket, counted by the workers."""
    return f"{PREFIX}:started:{_tier_lane(tier, lane)}:{bucket}"


def finished_tier_bucket(tier: Tier | str, bucket: int, lane: str | None = None) -> str:
    """Runs of one tier's jobs of a lane that ended in one 10-second bucket, counted by the
    workers."""
    return f"{PREFIX}:finished:{_tier_lane(tier, lane)}:{bucket}"


def run_ms_bucket(tier: Tier | str, bucket: int, lane: str | None = None) -> str:
    """Milliseconds the runs counted by `finished_tier_bucket` took together."""
    return f"{PREFIX}:run-ms:{_tier_lane(tier, lane)}:{bucket}"


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
"""Every job's final event is announced here by its job id, one message naming every job one
publishing call ended, space-separated (see `api.final_events`)."""

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

WORKER_LANES = f"{PREFIX}:worker-lanes"
"""Hash of worker name to lane (see `queue_name`), for workers that serve a model of their own;
kept, like `WORKERS_SET`, after the worker is gone, so its own queues go back to its lane."""

DATA_MARK = f"{PREFIX}:data-mark"
"""Never expires: its absence tells the scheduler that Redis lost its data (see `reaper`)."""
