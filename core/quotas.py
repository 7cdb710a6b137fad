"""Per-key quotas: requests per minute, tokens per minute and concurrent jobs, kept in Redis.

Rates use GCRA (a token bucket that stores one timestamp): a key may spend a minute's worth at
once, then at its steady rate. Concurrent jobs are a sorted set per key, scored by each job's
deadline; a job leaves it when its final event is published (see `core.events`), or at its
deadline if that event was lost. One script checks all three and, only if every one admits the
jobs, records them, so a refused request consumes nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from core import keys
from core.apikeys import Quota
from core.errors import QuotaTooSmall, RateLimited

_ADMIT_SCRIPT = """
local now = tonumber(ARGV[1])
local rpm, tpm, max_active = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local count, tokens, ttl = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local function gcra(key, limit, cost)
  if limit <= 0 then return 0, nil end
  if cost > limit then return -1, nil end
  local interval = 60000 / limit
  local tat = tonumber(redis.call('GET', key) or now)
  if tat < now then tat = now end
  local new_tat = tat + cost * interval
  local wait = new_tat - 60000 - now
  if wait > 0 then return wait, nil end
  return 0, new_tat
end
local wait_requests, tat_requests = gcra(KEYS[1], rpm, count)
if wait_requests < 0 then return {'requests', -1} end
local wait_tokens, tat_tokens = gcra(KEYS[2], tpm, tokens)
if wait_tokens < 0 then return {'tokens', -1} end
if wait_requests > 0 then return {'requests', wait_requests} end
if wait_tokens > 0 then return {'tokens', wait_tokens} end
if max_active > 0 then
  if count > max_active then return {'concurrent', -1} end
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) + count > max_active then return {'concurrent', 1000} end
end
if tat_requests then redis.call('SET', KEYS[1], tat_requests, 'PX', 120000) end
if tat_tokens then redis.call('SET', KEYS[2], tat_tokens, 'PX', 120000) end
if max_active > 0 then
  -- each job remembers its set (keys.job_quota_set), so its final event can leave it
  for i = 8, #ARGV, 2 do
    redis.call('ZADD', KEYS[3], ARGV[i + 1], ARGV[i])
    redis.call('SET', 'inferq:job:' .. ARGV[i] .. ':quota', KEYS[3], 'EX', ttl)
  end
  redis.call('PEXPIRE', KEYS[3], ttl * 1000)
end
return {'ok', 0}
"""


@dataclass(frozen=True)
class Admission:
    """One job asking to be admitted: its id, the tokens it may use, its deadline."""

    job_id: str
    tokens: int
    deadline_s: float


class QuotaLimiter:
    """Admits or refuses jobs against their key's quota."""

    def __init__(self, client: aioredis.Redis, ttl_s: int) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self._script = client.register_script(_ADMIT_SCRIPT)

    async def admit(self, key_id: int, quota: Quota, jobs: list[Admission]) -> None:
        """Record the jobs against the key, or raise RateLimited (429) / QuotaTooSmall (400)."""
        if quota.unlimited or not jobs:
            return
        now_ms = int(time.time() * 1000)
        members: list[str | int] = []
        for job in jobs:
            members += [job.job_id, int(job.deadline_s * 1000)]
        tokens = sum(job.tokens for job in jobs)
        reason, wait_ms = await self._script(
            keys=[
                keys.key_rate(key_id, "requests"),
                keys.key_rate(key_id, "tokens"),
                keys.key_active(key_id),
            ],
            args=[
                now_ms,
                quota.requests_per_minute or 0,
                quota.tokens_per_minute or 0,
                quota.max_concurrent or 0,
                len(jobs),
                tokens,
                self.ttl_s,
                *members,
            ],
        )
        reason = reason.decode() if isinstance(reason, bytes) else str(reason)
        if reason == "ok":
            return
        limit = {
            "requests": f"{quota.requests_per_minute} requests per minute",
            "tokens": f"{quota.tokens_per_minute} tokens per minute",
            "concurrent": f"{quota.max_concurrent} concurrent jobs",
        }[reason]
        asked = {"requests": len(jobs), "tokens": tokens, "concurrent": len(jobs)}[reason]
        if int(wait_ms) < 0:
            raise QuotaTooSmall(
                f"This request needs {asked} of this key's {limit} at once; it can never fit.",
                param="max_tokens" if reason == "tokens" else None,
            )
        retry_after = max(1, -(-int(wait_ms) // 1000))
        raise RateLimited(
            f"This key's quota of {limit} is used up; retry in {retry_after} s.",
            retry_after=retry_after,
        )
