"""Worker names held in Redis: one live process per name, however many start on one host.

A worker's name is its Celery node name, its own queues' suffix, its stats key and the `worker`
of the jobs it runs; two processes with one name look like one node that keeps changing. So a
worker claims its name before it goes by it: a key per name (`keys.worker_name_claim`) set only
if absent, holding a token of this process, with a short TTL that a daemon thread renews while
the process lives. A process that dies without releasing its name frees it within the TTL.

The claim is also how a dead worker is noticed in seconds, whatever the job leases' length: a
worker's lease tokens start with its claim's token (`lease_token`), so a lease whose maker no
longer holds its name (`lease_holder` differs from the name's claim, or the claim is gone)
belongs to a process that died or stalled past the TTL, and the scheduler hands its job on.

A renewal that comes late is logged with how late it came. The threads' stacks are not dumped
then: `faulthandler.dump_traceback_later`, the one way to dump them without the GIL, walks the
other threads' frames while those threads run, and a worker continued after a stop (SIGCONT, a
VM resumed) was seen to die of a segmentation fault in mid-dump. To see what a live worker is
doing, dump its stacks from outside the process (`py-spy dump --pid PID`, which needs
ptrace rights: in a container, the `SYS_PTRACE` capability).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable

import redis

from core import keys
from core.errors import InferqError

log = logging.getLogger(__name__)

NAME_TTL_S = 5.0
"""A name whose process stops renewing it is free again this long after the last renewal, and
the jobs it runs are taken for lost (renewed every TTL/3 from a thread of its own); the
worker's default (`INFERQ_WORKER_NAME_TTL_S`)."""

STARTING_TTL_S = 120.0
"""The claim's TTL until its worker has loaded the engine (`WorkerNameClaim.started`): loading
torch and vLLM can hold the GIL, and so stall the renewal thread, for tens of seconds on a busy
host (19 s was seen on 2 vCPUs), and a lapsed name could be taken by a worker starting beside."""

CONNECT_RETRY_S = 1.0
"""How often a worker that cannot reach Redis at start tries again."""

# KEYS[1]: the name's claim. ARGV: this process's token, the TTL in ms.
# 1: renewed; 2: the claim was gone (Redis lost it, or it lapsed) and is ours again;
# 0: another process holds it now.
_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
return 0
"""

# KEYS[1]: the name's claim. ARGV[1]: this process's token. Deletes it only if it is still ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class WorkerNameTaken(InferqError):
    """A live process already goes by the worker name asked for."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"a live worker already goes by {name!r}: stop it, or start this one with another "
            "--name (without --name, a worker takes the first free name for its devices)"
        )
        self.name = name


class WorkerNameClaim:
    """This process's claim on one worker name: renewed every TTL/3 until `release`.

    Until `started`, each renewal extends it by the longer `starting_ttl_s`.
    """

    def __init__(
        self,
        client: redis.Redis,
        name: str,
        token: str,
        ttl_s: float = NAME_TTL_S,
        starting_ttl_s: float = STARTING_TTL_S,
    ) -> None:
        self.client = client
        self.name = name
        self.token = token
        self.ttl_ms = int(ttl_s * 1000)
        self._current_ttl_ms = int(max(starting_ttl_s, ttl_s) * 1000)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._stopped = threading.Event()
        self._renewer = threading.Thread(
            target=self._renew_loop, name="inferq-name-renewer", daemon=True
        )

    def start_renewing(self) -> WorkerNameClaim:
        """Keep the claim alive from a daemon thread."""
        self._renewer.start()
        return self

    def started(self) -> None:
        """The worker has started: from now on the claim lapses a TTL after its last renewal."""
        self._current_ttl_ms = self.ttl_ms
        try:
            self.renew()
        except redis.RedisError as exc:  # the renewal thread sets it at its next turn
            log.warning("could not renew worker name %r (%s)", self.name, exc)

    def renew(self) -> bool:
        """Extend the claim (or take it again if Redis lost it); False if another holds it."""
        ttl_ms = self._current_ttl_ms
        answer = int(
            self._renew(keys=[keys.worker_name_claim(self.name)], args=[self.token, ttl_ms])
        )
        if answer == 2:
            log.warning("the claim on worker name %r had gone; it is held again", self.name)
        return answer != 0

    def release(self) -> None:
        """Stop renewing and free the name, if it is still this process's."""
        self._stopped.set()
        try:
            self._release(keys=[keys.worker_name_claim(self.name)], args=[self.token])
        except redis.RedisError:  # it lapses within the TTL by itself
            log.warning("could not release worker name %r", self.name, exc_info=True)

    def _renew_loop(self) -> None:
        held = True
        interval_s = self.ttl_ms / 3000
        last = time.monotonic()
        while not self._stopped.wait(interval_s):
            try:
                renewed = self.renew()
            except redis.RedisError as exc:  # once Redis is back, the claim is taken again
                log.warning("could not renew worker name %r (%s); retrying", self.name, exc)
                continue
            now = time.monotonic()
            if now - last > 2 * interval_s:  # a stall of the process: its jobs are at risk
                log.warning(
                    "worker name %r renewed %.1fs after the last renewal (every %.1fs, lapses "
                    "after %.0fs)",
                    self.name,
                    now - last,
                    interval_s,
                    self._current_ttl_ms / 1000,
                )
            last = now
            if held and not renewed:
                log.error(
                    "another process now goes by worker name %r (this one stalled past %.0fs)",
                    self.name,
                    self.ttl_ms / 1000,
                )
            held = renewed


def lease_token(claim_token: str) -> str:
    """A new job-lease token for the process whose name claim holds `claim_token`."""
    return f"{claim_token}:{time.monotonic_ns()}"


def lease_holder(lease: bytes | str) -> str:
    """The claim token of the process that took a lease (see `lease_token`)."""
    value = lease.decode() if isinstance(lease, bytes) else lease
    return value.rsplit(":", 1)[0]


def _process_token() -> str:
    """A token no other process has: host, process id and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"


def claim_first_free(
    client: redis.Redis,
    names: Iterable[str],
    *,
    ttl_s: float = NAME_TTL_S,
    starting_ttl_s: float = STARTING_TTL_S,
) -> WorkerNameClaim:
    """Claim the first of `names` that no live process holds (atomically: SET NX)."""
    token = _process_token()
    first = None
    for name in names:
        first = first or name
        if _try_claim(client, name, token, max(starting_ttl_s, ttl_s)):
            return WorkerNameClaim(client, name, token, ttl_s, starting_ttl_s).start_renewing()
    raise WorkerNameTaken(first or "")


def claim_name(
    client: redis.Redis,
    name: str,
    *,
    ttl_s: float = NAME_TTL_S,
    starting_ttl_s: float = STARTING_TTL_S,
    wait_s: float | None = None,
    poll_s: float = 0.25,
) -> WorkerNameClaim:
    """Claim `name`, waiting up to `wait_s` (default TTL + 1 s) for its holder to go.

    The holder may be this worker's own previous life, killed and restarted at once: its claim
    lapses within the TTL (or `starting_ttl_s`, had it not finished starting). Raises
    `WorkerNameTaken` if it is still held after the wait.
    """
    token = _process_token()
    wait_s = ttl_s + 1 if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    waited = False
    while not _try_claim(client, name, token, max(starting_ttl_s, ttl_s)):
        if time.monotonic() >= deadline:
            raise WorkerNameTaken(name)
        if not waited:
            log.info("worker name %r is held; waiting up to %.0fs for it", name, wait_s)
            waited = True
        time.sleep(poll_s)
    return WorkerNameClaim(client, name, token, ttl_s, starting_ttl_s).start_renewing()


def _try_claim(client: redis.Redis, name: str, token: str, ttl_s: float) -> bool:
    """SET NX the name's claim; a worker started before Redis waits for it."""
    while True:
        try:
            claimed = client.set(keys.worker_name_claim(name), token, nx=True, px=int(ttl_s * 1000))
        except redis.AuthenticationError:  # waiting would not help
            raise
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("could not reach Redis to claim worker name %r (%s); retrying", name, exc)
            time.sleep(CONNECT_RETRY_S)
            continue
        return bool(claimed)
