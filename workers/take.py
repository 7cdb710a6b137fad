"""The take: the one way a worker's channel gets messages from its queues (`workers.edge`).

One Lua script pops up to as many messages as the worker has room for, in polling order
(premium before standard before basic, a worker's own queue before the shared one), within each
tier's room, and records each as unacknowledged the way kombu's QoS does, in the same atomic
step. No message is ever off every list in Redis: a worker that dies, or whose connection drops
before the reply, leaves what it took recorded for the handoff (`core.queue.unstarted`).
"""

from __future__ import annotations

import time
from typing import Any

from core import keys
from core.tiers import TIERS_BY_PRIORITY, Tier

# KEYS: the lists in polling order, then the unacked hash and its index. ARGV: how many, now,
# the number of tier groups G, each group's room, then each list's group (0: no limit), then
# each list's wake-up list. Pops up to ARGV[1] messages, first list first, at most a group's
# room from its lists (a take from group g uses up room in g and every later group: a lower
# tier's room counts the jobs of the tiers above it), and records each as unacknowledged the way
# the transport's QoS does: hash[tag] = [message, exchange, routing key], index[tag] = now. A
# list's messages come in one RPOP, and the take's records in one HSET and one ZADD: a take of
# 32 messages costs a few commands, not three per message.
# Deletes, in one DEL, the wake-up lists of the queues it found empty (`core.queue.wake`); an
# empty take (all lists missing) costs one EXISTS and that DEL.
_TAKE = """
local unacked, index = KEYS[#KEYS - 1], KEYS[#KEYS]
local lists = #KEYS - 2
local want = tonumber(ARGV[1])
local groups = tonumber(ARGV[3])
local wakes = 3 + groups + lists
local empty = {}
local function unwake()
  local drained = {}
  for i = 1, lists do
    local wake = ARGV[wakes + i]
    drained[wake] = (drained[wake] ~= false) and (empty[i] == true)
  end
  local gone = {}
  for wake, yes in pairs(drained) do
    if yes then table.insert(gone, wake) end
  end
  if #gone > 0 then redis.call('DEL', unpack(gone)) end
end
if redis.call('EXISTS', unpack(KEYS, 1, lists)) == 0 then
  for i = 1, lists do empty[i] = true end
  unwake()
  return {}
end
local room = {}
for g = 1, groups do room[g] = tonumber(ARGV[3 + g]) end
local taken, fields, members = {}, {}, {}
for i = 1, lists do
  local g = tonumber(ARGV[3 + groups + i])
  local n = want
  if g > 0 then n = math.min(n, room[g]) end
  if n > 0 then
    local items = redis.call('RPOP', KEYS[i], n) or {}
    if #items < n then empty[i] = true end
    for _, item in ipairs(items) do
      local ok, message = pcall(cjson.decode, item)
      if ok and type(message) == 'table' and type(message.properties) == 'table'
          and message.properties.delivery_tag then
        local info = message.properties.delivery_info or {}
        local tag = message.properties.delivery_tag
        table.insert(fields, tag)
        table.insert(fields, '[' .. item .. ',' .. cjson.encode(info.exchange or '') .. ','
          .. cjson.encode(info.routing_key or '') .. ']')
        table.insert(members, ARGV[2])
        table.insert(members, tag)
      end
      table.insert(taken, KEYS[i])
      table.insert(taken, item)
    end
    want = want - #items
    if g > 0 then
      for later = g, groups do room[later] = room[later] - #items end
    end
  end
end
-- one HSET and one ZADD for the whole take (in calls of at most 500 messages: `unpack`'s limit)
for i = 1, #fields, 1000 do
  local last = math.min(i + 999, #fields)
  redis.call('HSET', unacked, unpack(fields, i, last))
  redis.call('ZADD', index, unpack(members, i, last))
end
unwake()
return taken
"""


def take_command(
    lists: list[tuple[str, str]], unacked: tuple[str, str], want: int, rooms: dict[Tier, int]
) -> list[Any]:
    """The EVAL of a take of up to `want` messages from `lists` ((list, its queue) in polling
    order), at most `rooms[tier]` from a tier's lists (no limit for a tier not in `rooms`),
    recorded in `unacked` (kombu's unacked hash and its index)."""
    # One group per tier, best first (see _TAKE); a list of no known tier has no limit.
    tiers = [tier for tier in TIERS_BY_PRIORITY if tier in rooms]
    group_of = {tier: index + 1 for index, tier in enumerate(tiers)}
    queue_tiers = [keys.tier_of_queue(queue) for _, queue in lists]
    groups = [group_of.get(tier, 0) if tier else 0 for tier in queue_tiers]
    return [
        "EVAL",
        _TAKE,
        len(lists) + 2,
        *(name for name, _ in lists),
        *unacked,
        want,
        time.time(),
        len(tiers),
        *(rooms[t] for t in tiers),
        *groups,
        *(keys.queue_wake(queue) for _, queue in lists),
    ]
