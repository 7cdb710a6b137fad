"""Fair, aging dispatch into the tier queues.

The Celery queue of a tier is a plain FIFO list that workers pop in tier order. Two things it
cannot do by itself are done here:

- **Fair share between owners.** While a tier's queue holds fewer than `dispatch_backlog`
  messages and nothing is held back, a job goes straight onto it (the common, unloaded case:
  no extra hop). Past that, jobs wait in per-owner lists (`inferq:held:{tier}:{owner}`), and the
  scheduler's dispatcher refills the queue from them round-robin, least recently served owner
  first. One owner's flood then sits in its own list, and another owner's job is at most one
  round behind it, not behind the whole flood.
- **Aging.** A lower tier's message that waited past the tier's `promote_after_s` moves to the
  front of the premium queue (`core.queue.aging`).
- **Lanes.** A deployment that serves more models (`Settings.models`) has a set of tier queues
  per model, a lane: `inferq.{tier}.model.{name}`, taken only by workers of that model. All of
  the above holds within each lane; the first model's lane keeps the plain names.
- **Prefix routing.** A job with a long prompt is sent to the worker its prefix hashes to (see
  `core.queue.routing`); the dispatcher also hands lost workers' own queues back to the shared
  ones.

The dispatcher polls for room only while jobs are held; otherwise it blocks on a wake list
that holding a job pushes to, so an idle system costs Redis almost nothing.

Every move is one Lua script, and a job taken from a held list is parked in the set
`inferq:parked:{tier}` until its message is sent, so a dispatcher that dies mid-move leaves
the job to be sent by the next one (a duplicate message is harmless: workers skip a job that is
claimed or final).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import redis
from celery import Celery
from kombu.exceptions import KombuError

from core import keys
from core.models import Job, as_utc
from core.queue.aging import Aging
from core.queue.app import ENQUEUED_AT_HEADER, enqueue_jobs
from core.queue.routing import WorkerDirectory, pick_worker, prefix_key
from core.settings import Settings
from core.tiers import TIERS_BY_PRIORITY, Tier

log = logging.getLogger(__name__)

# Room in a tier's queue: its backlog less the messages in it and those on their way to it
# (counted in `sending` until sent, or parked in `dispatching`; the count lapses by itself if a
# sender dies). `push_all` adds many values to a list or set in calls of at most 1,000 (Lua's
# `unpack` has a limit): a group of jobs costs Redis a command per owner, not one per job.
_COMMON = """
local function room(backlog)
  return backlog - redis.call('LLEN', KEYS[1]) - redis.call('SCARD', KEYS[5])
    - tonumber(redis.call('GET', KEYS[6]) or '0')
end
local function push_all(command, key, values)
  for i = 1, #values, 1000 do
    redis.call(command, key, unpack(values, i, math.min(i + 999, #values)))
  end
end
"""

# KEYS: queue, held count, owners zset, round counter, dispatching set, sending count, wake
# list. ARGV: backlog, held-list prefix, then (owner, entry) pairs. Returns the entries to send
# now (counted as sending); the rest are held, in order, and a token on the wake list wakes a
# dispatcher.
_HOLD_OR_SEND = (
    _COMMON
    + """
local room = room(tonumber(ARGV[1]))
local held = tonumber(redis.call('GET', KEYS[2]) or '0')
local send, owners, by_owner = {}, {}, {}
for i = 3, #ARGV, 2 do
  if held == 0 and room > 0 then
    table.insert(send, ARGV[i + 1])
    room = room - 1
  else
    local owner = ARGV[i]
    if not by_owner[owner] then
      by_owner[owner] = {}
      table.insert(owners, owner)
    end
    table.insert(by_owner[owner], ARGV[i + 1])
    held = held + 1
  end
end
if #owners > 0 then
  local round = tonumber(redis.call('GET', KEYS[4]) or '0')
  for _, owner in ipairs(owners) do
    push_all('RPUSH', ARGV[2] .. owner, by_owner[owner])
    redis.call('ZADD', KEYS[3], 'NX', round, owner)
  end
  redis.call('SET', KEYS[2], held)
  redis.call('LPUSH', KEYS[7], '1')
  redis.call('LTRIM', KEYS[7], 0, 0)
  redis.call('EXPIRE', KEYS[7], 60)
end
if #send > 0 then
  redis.call('INCRBY', KEYS[6], #send)
  redis.call('EXPIRE', KEYS[6], 30)
end
return send
"""
)

# KEYS: as above. ARGV: backlog, held-list prefix.
# Takes held entries round-robin across owners until the queue is full, in rounds: each owner
# waiting at a round's start, least recently served first, takes an equal share of the room left
# (at least one entry), and what an owner that runs short leaves goes to the next round. Parks
# the entries in the dispatching set.
_TAKE_HELD = (
    _COMMON
    + """
local taken = {}
local owners = redis.call('ZCARD', KEYS[3])
if owners == 0 then return taken end
local room = room(tonumber(ARGV[1]))
while room > 0 and owners > 0 do
  local share = math.max(1, math.floor(room / owners))
  for _ = 1, owners do
    if room <= 0 then break end
    local owner = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
    if not owner then break end
    local list = ARGV[2] .. owner
    local entries = redis.call('LPOP', list, math.min(share, room)) or {}
    if redis.call('LLEN', list) == 0 then
      redis.call('ZREM', KEYS[3], owner)
    else
      redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[4]), owner)
    end
    for _, entry in ipairs(entries) do table.insert(taken, entry) end
    room = room - #entries
  end
  owners = redis.call('ZCARD', KEYS[3])
end
if #taken > 0 then
  redis.call('DECRBY', KEYS[2], #taken)
  push_all('SADD', KEYS[5], taken)
end
return taken
"""
)


@dataclass(frozen=True)
class QueuedJob:
    """A committed job to put on its tier's queue."""

    id: str
    tier: str
    owner: str
    enqueued_at: float = field(default_factory=time.time)
    headers: dict[str, str] = field(default_factory=dict, compare=False)
    route: str | None = None
    """The prompt's prefix key, for jobs routed to a worker (see `core.queue.routing`)."""
    model: str | None = None
    """The job's model: one of `Settings.models` has queues of its own (its lane)."""

    def entry(self) -> str:
        """How the job is kept in a held list."""
        entry = f"{self.id} {self.enqueued_at:.6f}"
        return f"{entry} {self.route}" if self.route else entry


def queued(
    jobs: list[Job],
    headers: list[dict[str, str]] | None = None,
    *,
    route_chars: int = 0,
    routes: list[str | None] | None = None,
) -> list[QueuedJob]:
    """The stored jobs as dispatcher input (submission time: their `created_at`).

    Prompts of at least `route_chars` characters get a prefix key (0: none do); `routes`
    gives the keys instead, for jobs whose rows hold only part of their prompts.
    """
    return [
        QueuedJob(
            job.id,
            job.tier,
            job.owner,
            as_utc(job.created_at).timestamp(),
            headers[index] if headers else {},
            routes[index] if routes is not None else prefix_key(job.prompt, route_chars),
            job.model,
        )
        for index, job in enumerate(jobs)
    ]


def _parse(entry: bytes | str, tier: Tier, lane: str | None) -> QueuedJob:
    text = entry.decode() if isinstance(entry, bytes) else entry
    job_id, enqueued_at, *route = text.split(" ")
    route_key = route[0] if route else None
    return QueuedJob(job_id, tier.value, "", float(enqueued_at), route=route_key, model=lane)


class Dispatcher:
    """Puts jobs on the tier queues fairly; see the module docstring."""

    def __init__(self, settings: Settings, client: redis.Redis, celery: Celery) -> None:
        self.settings = settings
        self.redis = client
        self.celery = celery
        self._hold = client.register_script(_HOLD_OR_SEND)
        self._take = client.register_script(_TAKE_HELD)
        self.workers = WorkerDirectory(client)
        self.lanes = settings.lanes
        self.aging = Aging(settings, client, self.workers)
        self._deferred: list[QueuedJob] = []
        self._deferred_lock = threading.Lock()

    def _keys(self, tier: Tier, lane: str | None) -> list[str]:
        return [
            keys.queue_name(tier, lane),
            keys.held_count(tier, lane),
            keys.held_owners(tier, lane),
            keys.held_round(tier, lane),
            keys.dispatching(tier, lane),
            keys.sending_count(tier, lane),
            keys.DISPATCH_WAKE,
        ]

    def _queues(self) -> list[tuple[Tier, str | None]]:
        """Every (tier, lane) with a queue, in tier order."""
        return [(tier, lane) for tier in TIERS_BY_PRIORITY for lane in self.lanes]

    def submit(self, jobs: list[QueuedJob]) -> None:
        """Enqueue committed jobs now, or hold them in their owners' lists if the queue is full."""
        by_queue: dict[tuple[str, str | None], list[QueuedJob]] = {}
        for job in jobs:
            by_queue.setdefault((job.tier, self.settings.lane_of(job.model)), []).append(job)
        for tier, lane in self._queues():
            of_queue = by_queue.get((tier.value, lane))
            if not of_queue:
                continue
            held_prefix = keys.held_list(tier, "", lane)
            args: list[str | int] = [self.settings.dispatch_backlog, held_prefix]
            for job in of_queue:
                args += [job.owner, job.entry()]
            send = {raw.decode() for raw in self._hold(keys=self._keys(tier, lane), args=args)}
            if send:
                try:
                    self._send([job for job in of_queue if job.entry() in send])
                finally:
                    self.redis.decrby(keys.sending_count(tier, lane), len(send))

    def submit_or_defer(self, jobs: list[QueuedJob]) -> None:
        """`submit`, keeping the jobs for `send_deferred` if Redis cannot take them now.

        For jobs already committed: they are accepted, so a broker outage must not fail the
        request that stored them. Sent again whole, a job may get two messages; workers skip
        the second.
        """
        try:
            self.submit(jobs)
        except (redis.RedisError, KombuError) as exc:
            log.warning("could not enqueue %d stored jobs, will retry: %s", len(jobs), exc)
            with self._deferred_lock:
                self._deferred.extend(jobs)

    def has_deferred(self) -> bool:
        """Whether `submit_or_defer` kept jobs that are not sent yet."""
        with self._deferred_lock:
            return bool(self._deferred)

    def send_deferred(self) -> int:
        """Try again to enqueue the jobs `submit_or_defer` kept; how many are still waiting."""
        with self._deferred_lock:
            jobs, self._deferred = self._deferred, []
        if jobs:
            self.submit_or_defer(jobs)
        with self._deferred_lock:
            return len(self._deferred)

    def release(self) -> int:
        """Refill every tier's queue from the held lists; returns how many jobs were sent."""
        sent = 0
        for tier, lane in self._queues():
            parked = keys.dispatching(tier, lane)
            held_prefix = keys.held_list(tier, "", lane)
            args: list[str | int] = [self.settings.dispatch_backlog, held_prefix]
            taken = self._take(keys=self._keys(tier, lane), args=args)
            if taken:
                self._send([_parse(entry, tier, lane) for entry in taken])
                for start in range(0, len(taken), 1000):
                    self.redis.srem(parked, *taken[start : start + 1000])
                sent += len(taken)
        return sent

    def recover(self) -> int:
        """Send the jobs a dispatcher parked but may not have sent (run at start)."""
        resent = 0
        for tier, lane in self._queues():
            parked = keys.dispatching(tier, lane)
            legacy = keys.dispatching_list(tier, lane)  # a dispatcher's from before the set
            found = (
                (parked, self.redis.smembers(parked)),
                (legacy, self.redis.lrange(legacy, 0, -1)),
            )
            for key, entries in found:
                if entries:
                    self._send([_parse(entry, tier, lane) for entry in entries])
                    self.redis.delete(key)
                    resent += len(entries)
        return resent

    def _send(self, jobs: list[QueuedJob]) -> None:
        """Put the jobs' messages on their queues: a routed job's worker's own, or its tier's
        (of its model's lane)."""
        enqueue_jobs(
            self.celery,
            [(job.id, job.tier) for job in jobs],
            [{**job.headers, ENQUEUED_AT_HEADER: f"{job.enqueued_at:.6f}"} for job in jobs],
            [
                route or keys.queue_name(job.tier, self.settings.lane_of(job.model))
                for job, route in zip(jobs, self._routes(jobs), strict=True)
            ],
        )

    def _routes(self, jobs: list[QueuedJob]) -> list[str | None]:
        """Each job's worker queue, or None: not routed, no live worker of its model, or that
        one is busy."""
        if not any(job.route for job in jobs):
            return [None] * len(jobs)
        chosen = [
            keys.worker_queue_name(job.tier, worker)
            if job.route
            and (
                worker := pick_worker(
                    job.route,
                    self.workers.serving(self.settings.lane_of(job.model), Tier(job.tier)),
                )
            )
            else None
            for job in jobs
        ]
        targets = sorted({target for target in chosen if target})
        pipe = self.redis.pipeline(transaction=False)
        for name in targets:
            pipe.llen(name)
        waiting = dict(zip(targets, pipe.execute(), strict=True))
        routes: list[str | None] = []
        for target in chosen:
            if target is not None and waiting[target] < self.settings.prefix_route_backlog:
                waiting[target] += 1
                routes.append(target)
            else:
                routes.append(None)
        return routes

    def promote(self, now: float | None = None) -> int:
        """Age waiting messages into the premium queues (see `core.queue.aging`)."""
        return self.aging.promote(now)

    def held(self) -> dict[str, int]:
        """Jobs held back per tier, over every lane."""
        queues = self._queues()
        values = self.redis.mget([keys.held_count(tier, lane) for tier, lane in queues])
        held = {tier.value: 0 for tier in TIERS_BY_PRIORITY}
        for (tier, _), value in zip(queues, values, strict=True):
            held[tier.value] += int(value or 0)
        return held

    def run(self, stopped: threading.Event, interval_s: float = 0.02, idle_s: float = 0.5) -> None:
        """Release held jobs and age queued ones until `stopped` is set.

        While jobs are held it polls for room every `interval_s` (workers free room by taking
        messages, which nothing announces). With nothing held it blocks on the wake list, which
        the API pushes to when it holds a job, for up to `idle_s`, the aging and reclaim cadence:
        an idle system costs a round trip every half second, not fifty a second.
        """
        recovered = self.recover()
        if recovered:
            log.info("dispatcher: re-sent %d parked jobs", recovered)
        last_promote = 0.0
        while not stopped.is_set():
            try:
                self.release()
                if time.monotonic() - last_promote >= idle_s:
                    last_promote = time.monotonic()
                    promoted = self.promote()
                    if promoted:
                        log.info("dispatcher: %d waiting jobs promoted to premium", promoted)
                    reclaimed = self.workers.reclaim()
                    if reclaimed:
                        log.info(
                            "dispatcher: %d jobs of lost workers back in the queues", reclaimed
                        )
                if any(self.held().values()):
                    stopped.wait(interval_s)
                else:
                    self.redis.blpop([keys.DISPATCH_WAKE], timeout=idle_s)
            except redis.RedisError as exc:
                log.warning("dispatcher: Redis unavailable; retrying: %s", exc)
                stopped.wait(1.0)
