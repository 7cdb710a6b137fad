"""Job leases in Redis, claimed, renewed and released for a whole batch of jobs in one call.

A worker holds a job while a key with its own token lives (`keys.job_lease`). A burst of jobs is
claimed, renewed and released by one script call each, not one command per job: on a host where
the engine ends a burst of 256 short jobs in under a second, the client side of a few hundred
pipelined commands is a measurable share of the worker's CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import redis

from core import keys

# KEYS: n lease keys, then the same n jobs' cancel flags. ARGV: the lease in ms, then n tokens.
# Per job: 0 if another worker holds it, 1 if claimed here, 2 if claimed and a cancel was asked.
# A SET per job (each with its own expiry), and the claimed jobs' cancel flags in one MGET.
_CLAIM_SCRIPT = """
local n = #KEYS / 2
local answers, flags = {}, {}
for i = 1, n do
  if redis.call('SET', KEYS[i], ARGV[i + 1], 'NX', 'PX', ARGV[1]) then
    answers[i] = 1
    table.insert(flags, i)
  else
    answers[i] = 0
  end
end
for first = 1, #flags, 1000 do
  local last = math.min(first + 999, #flags)
  local names = {}
  for j = first, last do table.insert(names, KEYS[n + flags[j]]) end
  local values = redis.call('MGET', unpack(names))
  for j = first, last do
    if values[j - first + 1] then answers[flags[j]] = 2 end
  end
end
return answers
"""

# Delete each lease only if it is still ours (KEYS[i] holds ARGV[i]): a lapsed lease may already
# belong to another worker. One MGET and one DEL for the whole batch. Returns how many were
# deleted.
_RELEASE_SCRIPT = """
local released = 0
for first = 1, #KEYS, 1000 do
  local last = math.min(first + 999, #KEYS)
  local held = redis.call('MGET', unpack(KEYS, first, last))
  local ours, seen = {}, {}
  for i = first, last do
    if held[i - first + 1] == ARGV[i] and not seen[KEYS[i]] then
      seen[KEYS[i]] = true
      table.insert(ours, KEYS[i])
    end
  end
  if #ours > 0 then released = released + redis.call('DEL', unpack(ours)) end
end
return released
"""

# Extend each lease to ARGV[1] ms.
_RENEW_SCRIPT = """
for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
return #KEYS
"""

Client = redis.Redis | redis.client.Pipeline


class Leases:
    """The lease scripts, registered on one client; each call may go on a pipeline instead."""

    def __init__(self, client: redis.Redis, ttl_s: float) -> None:
        self.ttl_ms = int(ttl_s * 1000)
        self._claim = client.register_script(_CLAIM_SCRIPT)
        self._release = client.register_script(_RELEASE_SCRIPT)
        self._renew = client.register_script(_RENEW_SCRIPT)

    def claim(self, tokens: Mapping[str, str], client: Client) -> Any:
        """Claim each job (id → new token) unless another holds it; see `claimed` for the reply."""
        if not tokens:
            return []
        job_ids = list(tokens)
        script_keys = [keys.job_lease(i) for i in job_ids]
        script_keys += [keys.job_cancel_flag(i) for i in job_ids]
        return self._claim(keys=script_keys, args=[self.ttl_ms, *tokens.values()], client=client)

    @staticmethod
    def claimed(job_ids: Sequence[str], reply: Sequence[int]) -> dict[str, bool]:
        """From `claim`'s reply: job id → whether a cancel was asked, for the jobs claimed here."""
        answers = zip(job_ids, reply, strict=True)
        return {job_id: answer == 2 for job_id, answer in answers if answer}

    def release(self, leases: Sequence[tuple[str, str]], client: Client) -> Any:
        """Delete the leases, given as (job id, token), that are still held with their tokens."""
        if not leases:
            return 0
        return self._release(
            keys=[keys.job_lease(job_id) for job_id, _ in leases],
            args=[token for _, token in leases],
            client=client,
        )

    def renew(self, job_ids: Sequence[str], client: Client) -> Any:
        """Extend the jobs' leases by the lease time from now."""
        if not job_ids:
            return 0
        return self._renew(
            keys=[keys.job_lease(i) for i in job_ids], args=[self.ttl_ms], client=client
        )


class StaleLeases:
    """Lease tokens this worker may hold without knowing it: a claim or a release whose reply
    was lost. Thread-safe: the starter, the outcome recorder and the heartbeat all use it.

    Until such a lease is released, another worker that gets the job's message finds it held
    and skips the job. The starter releases a job's stale tokens before claiming it again, and
    the heartbeat releases whatever is left (`pending`, then `forget` once Redis has answered),
    so none waits for the lease to lapse or stays here after its job has gone elsewhere.
    """

    def __init__(self) -> None:
        self._tokens: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def add(self, job_id: str, tokens: Sequence[str]) -> None:
        """Note tokens of the job's lease that may still be set in Redis."""
        with self._lock:
            self._tokens.setdefault(job_id, []).extend(tokens)

    def take(self, job_ids: Iterable[str]) -> list[tuple[str, str]]:
        """Remove and return the (job id, token) pairs noted for these jobs."""
        with self._lock:
            return [(i, t) for i in job_ids for t in self._tokens.pop(i, ())]

    def pending(self) -> list[tuple[str, str]]:
        """Every (job id, token) pair noted, left in place (see `forget`)."""
        with self._lock:
            return [(i, t) for i, tokens in self._tokens.items() for t in tokens]

    def forget(self, released: Iterable[tuple[str, str]]) -> None:
        """Drop pairs whose release Redis has answered; tokens noted since are kept."""
        with self._lock:
            for job_id, token in released:
                tokens = self._tokens.get(job_id)
                if tokens is not None and token in tokens:
                    tokens.remove(token)
                    if not tokens:
                        del self._tokens[job_id]

    def __len__(self) -> int:
        with self._lock:
            return sum(len(tokens) for tokens in self._tokens.values())
