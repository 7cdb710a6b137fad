"""Wake-up lists: how a waiting worker hears that a queue has messages, without popping one.

A worker takes messages only through its take script (`workers.edge`), which pops them and
records them as unacknowledged in one atomic step, so no message is ever off every list in
Redis while its reply is on the wire. Redis cannot block inside a script, so a worker with
nothing to take waits by BLPOP on the wake-up lists of its queues (`core.keys.queue_wake`), and
takes when a token comes or its wait times out. Whatever puts messages on a queue pushes tokens
onto that queue's wake-up list in the same round trip, after the messages: one per message, at
most `WAKE_TOKENS`, so a burst wakes that many waiting workers and a flood does not grow the
list. The take deletes the wake-up list of a queue it leaves empty.

A token is only a hint. A missing one (kombu's own visibility restore, a reject with requeue,
a publisher of another version) costs a waiting worker at most its wait's timeout, and a stale
one an empty take.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core import keys

WAKE_TOKENS = 16
"""Most tokens a wake-up list holds: how many waiting workers one burst wakes at once."""

_WAKE_PREFIX = keys.queue_wake("")

WAKE_LUA = f"""
local function wake(queue, n)
  if n <= 0 then return end
  local key = '{_WAKE_PREFIX}' .. queue
  local tokens = {{}}
  for i = 1, math.min(n, {WAKE_TOKENS}) do tokens[i] = '1' end
  redis.call('LPUSH', key, unpack(tokens))
  redis.call('LTRIM', key, 0, {WAKE_TOKENS - 1})
end
local function unwake(queue)
  redis.call('DEL', '{_WAKE_PREFIX}' .. queue)
end
"""
"""Lua functions for the scripts that move messages: `wake(queue, n)` after putting `n` messages
on a queue, `unwake(queue)` after emptying one for good."""


def push_wakes(pipe: Any, counts: Mapping[str, int]) -> None:
    """Queue, on a Redis pipeline, the tokens for `counts` messages just put on each queue."""
    for queue, count in counts.items():
        if count > 0:
            wake = keys.queue_wake(queue)
            pipe.lpush(wake, *([b"1"] * min(count, WAKE_TOKENS)))
            pipe.ltrim(wake, 0, WAKE_TOKENS - 1)
