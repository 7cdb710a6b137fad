"""Cancelled jobs out of the held lists.

Jobs past a tier queue's backlog wait in per-owner held lists (`core.queue.dispatch`), and
admission control counts them as waiting. A job cancelled while held would count until the
dispatcher sent its message and a worker skipped it: after a batch of 5,000 questions was
cancelled, the next batch of its tier was refused as if thousands of jobs waited ahead. So
cancelling takes the jobs out of their owner's list at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis

from core import keys

# KEYS: an owner's held list, the tier's held count, its owners zset. ARGV: the owner, then job
# ids. Removes those jobs' entries (jobs cancelled while held); returns how many it removed.
_DROP_HELD = """
local drop = {}
for i = 2, #ARGV do drop[ARGV[i]] = true end
local items = redis.call('LRANGE', KEYS[1], 0, -1)
local kept = {}
for i = 1, #items do
  if not drop[string.match(items[i], '^%S+')] then table.insert(kept, items[i]) end
end
local dropped = #items - #kept
if dropped == 0 then return 0 end
redis.call('DEL', KEYS[1])
for i = 1, #kept, 1000 do
  redis.call('RPUSH', KEYS[1], unpack(kept, i, math.min(i + 999, #kept)))
end
if #kept == 0 then redis.call('ZREM', KEYS[3], ARGV[1]) end
redis.call('DECRBY', KEYS[2], dropped)
return dropped
"""


async def drop_held(
    client: aioredis.Redis,
    tier: str,
    owner: str,
    job_ids: list[str],
    lanes: Sequence[str | None] = (None,),
) -> int:
    """Take cancelled jobs out of their owner's held lists in every lane, so they stop counting
    as waiting (admission control counts held jobs); returns how many were held. A job already
    sent is skipped by the worker that takes its message."""
    dropped = 0
    for lane in lanes if job_ids else ():
        lists = (
            keys.held_list(tier, owner, lane),
            keys.held_count(tier, lane),
            keys.held_owners(tier, lane),
        )
        dropped += int(await client.eval(_DROP_HELD, 3, *lists, owner, *job_ids))
    return dropped
