"""Aging: a job that waited too long in a lower tier's queue moves to the front of premium.

Every message carries its job's submission time (`inferq_enqueued_at`). A message in a lower
tier's queue older than that tier's `promote_after_s` is moved, atomically, to the consuming end
of the premium queue of its lane, so a basic job's wait stays bounded under sustained premium
load. A worker's own queues (see `core.queue.routing`) age the same way, into its own premium
queue, or into its lane's shared one where the worker takes no premium jobs. The dispatcher
(`core.queue.dispatch`) runs a pass every half second.
"""

from __future__ import annotations

import time

import redis

from core import keys
from core.queue.routing import WorkerDirectory
from core.queue.wake import WAKE_LUA
from core.settings import Settings
from core.tiers import TIERS_BY_PRIORITY

# KEYS: a lower tier's queue, the premium queue. ARGV: cutoff (Unix s), how many to scan.
# Moves messages submitted before the cutoff to the premium queue's consuming end, and wakes
# as many waiting workers (`core.queue.wake`).
_PROMOTE = (
    WAKE_LUA
    + """
local items = redis.call('LRANGE', KEYS[1], -tonumber(ARGV[2]), -1)
local moved = 0
for i = 1, #items do
  local ok, message = pcall(cjson.decode, items[i])
  if ok and type(message) == 'table' and type(message.headers) == 'table' then
    local at = tonumber(message.headers.inferq_enqueued_at)
    if at and at <= tonumber(ARGV[1]) and redis.call('LREM', KEYS[1], -1, items[i]) == 1 then
      redis.call('RPUSH', KEYS[2], items[i])
      moved = moved + 1
    end
  end
end
wake(KEYS[2], moved)
return moved
"""
)

PROMOTE_SCAN = 256
"""How many of a queue's oldest messages one aging pass looks at."""


class Aging:
    """Moves messages that waited past their tier's `promote_after_s` to premium."""

    def __init__(self, settings: Settings, client: redis.Redis, workers: WorkerDirectory) -> None:
        self.settings = settings
        self.workers = workers
        self._script = client.register_script(_PROMOTE)

    def promote(self, now: float | None = None) -> int:
        """Move lower tiers' messages that waited past `promote_after_s` to the premium queue.

        Shared queues age into the shared premium queue, a worker's own queues into its own
        (or into the shared one, where the worker takes no premium jobs).
        """
        now = time.time() if now is None else now
        top = TIERS_BY_PRIORITY[0]
        # (own queues' worker or None for the shared ones, lane)
        owners: list[tuple[str | None, str | None]] = [(None, lane) for lane in self.settings.lanes]
        owners += [(worker, self.workers.lane_of(worker)) for worker in self.workers.live()]
        takes_top = set(self.workers.live(top))
        moved = 0
        for tier in TIERS_BY_PRIORITY[1:]:
            after_s = self.settings.tier_policy(tier).promote_after_s
            if after_s is None:
                continue
            for worker, lane in owners:
                queues = [
                    keys.worker_queue_name(tier, worker) if worker else keys.queue_name(tier, lane),
                    keys.worker_queue_name(top, worker)
                    if worker in takes_top
                    else keys.queue_name(top, lane),
                ]
                moved += int(self._script(keys=queues, args=[now - after_s, PROMOTE_SCAN]))
        return moved
