"""What inferq relies on inside Celery and kombu, beyond their public API, and the check of it.

inferq's worker runs jobs faster and keeps tier order by adapting Celery in three places, each
of which leans on names that Celery and kombu do not promise to keep:

- `workers.edge`: kombu's Redis transport, subclassed for takes by one script (no BRPOP),
  waits on wake-up lists, per-tier room and deferred acks;
- `workers.tasks`: a task strategy that hands each message to the job runner, with Celery's
  worker state kept up to date by hand for its remote control;
- `RunJobMessages` (below): `run_job` messages built as kombu's Redis transport stores them.

The scheduler also reads kombu's records of unacknowledged messages, in every mode, to hand on
the jobs a lost worker took and never started (`core.queue.unstarted`); an entry it cannot read
is left to kombu's own restore.

`PRIVATE_NAMES` lists every such name and where it is used. `check()` runs when a worker, the
API or the scheduler starts: on a Celery or kombu outside the tested series, or when one of the
names is gone, it stops the process with a message that names them. `INFERQ_CELERY_MODE=stock`
runs none of the three adaptations (stock transport, Celery's own strategy, `send_task`) and
needs only Celery's public API, on any version (at the cost the benchmarks' docs measure).
"""

from __future__ import annotations

import base64
import importlib
import inspect
import json
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import version
from typing import Any

from celery import Celery

from core.queue.wake import push_wakes
from core.redisconn import sync_client

TESTED_SERIES = {"celery": "5.7", "kombu": "5.7"}
"""The minor series inferq's adaptations were tested on (pyproject pins the same)."""

PUBLISH_BATCH = 1000
"""Most messages sent in one Redis pipeline; a bigger group goes in several."""


@dataclass(frozen=True)
class PrivateName:
    """One attribute of a library class that inferq relies on, and who relies on it."""

    owner: str
    """The class, as `module:Class`."""
    name: str
    used_by: str
    instance: bool = False
    """Set in `__init__` rather than defined on the class."""

    def present(self) -> bool:
        """Whether the installed library still has it."""
        module_name, _, class_name = self.owner.partition(":")
        try:
            owner: Any = importlib.import_module(module_name)
            for part in class_name.split(".") if class_name else ():
                owner = getattr(owner, part)
        except (ImportError, AttributeError):
            return False
        if not self.instance:
            return hasattr(owner, self.name)
        return any(
            f"self.{self.name}" in inspect.getsource(vars(klass)["__init__"])
            for klass in inspect.getmro(owner)
            if "__init__" in vars(klass) and klass.__module__.startswith(("kombu", "celery"))
        )


_REDIS = "kombu.transport.redis"
_EDGE = "workers.edge"
PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName(f"{_REDIS}:Channel", "_brpop_start", _EDGE),
    PrivateName(f"{_REDIS}:Channel", "_brpop_read", _EDGE),
    PrivateName(f"{_REDIS}:Channel", "_in_poll", _EDGE),
    PrivateName(f"{_REDIS}:Channel", "_brpop_sent_at", _EDGE),
    PrivateName(f"{_REDIS}:Channel", "_flush_brpop_reauth", _EDGE),
    PrivateName(f"{_REDIS}:Channel", "_poll_error", _EDGE),
    PrivateName(f"{_REDIS}:Channel", "_q_for_pri", _EDGE),
    PrivateName(f"{_REDIS}:Channel", "_create_client", _EDGE),
    PrivateName(f"{_REDIS}:Channel", "from_transport_options", _EDGE),
    PrivateName(f"{_REDIS}:Channel", "conn_or_acquire", _EDGE),
    PrivateName(f"{_REDIS}:Channel", "priority_steps", _EDGE),
    PrivateName(f"{_REDIS}:Channel", "unacked_key", _EDGE),
    PrivateName(f"{_REDIS}:Channel", "unacked_index_key", _EDGE),
    PrivateName(f"{_REDIS}:Channel", "_queue_cycle", _EDGE, instance=True),
    PrivateName("kombu.transport.virtual.base:Channel", "_qos", _EDGE, instance=True),
    PrivateName(f"{_REDIS}:Channel", "unacked_key", "core.queue.unstarted"),
    PrivateName(f"{_REDIS}:Channel", "unacked_index_key", "core.queue.unstarted"),
    PrivateName(f"{_REDIS}:QoS", "restore_by_tag", "core.queue.unstarted (the entry it reads)"),
    PrivateName(f"{_REDIS}:QoS", "restore_unacked", _EDGE),
    PrivateName(f"{_REDIS}:QoS", "can_consume_max_estimate", _EDGE),
    PrivateName("kombu.transport.virtual.base:QoS", "_delivered", _EDGE, instance=True),
    PrivateName("kombu.transport.virtual.base:QoS", "_dirty", _EDGE, instance=True),
    PrivateName(f"{_REDIS}:Transport", "_deliver", _EDGE),
    PrivateName(f"{_REDIS}:Transport", "register_with_event_loop", _EDGE),
    PrivateName("celery.worker.state", "task_accepted", "workers.tasks"),
    PrivateName("celery.worker.state", "task_ready", "workers.tasks"),
    PrivateName("celery.worker.state", "active_requests", "workers.tasks"),
    PrivateName("celery.app.amqp:AMQP", "as_task_v2", "core.celery_compat.RunJobMessages"),
    PrivateName("celery.app.base:Celery", "thread_oid", "core.celery_compat.RunJobMessages"),
)


class UntestedCeleryError(RuntimeError):
    """Celery or kombu is not what inferq's adaptations of them were tested on."""


def problems(names: tuple[PrivateName, ...] = PRIVATE_NAMES) -> list[str]:
    """What stands between the installed Celery and kombu and inferq's adaptations of them."""
    found = [
        f"{package} {version(package)} is not the tested {series}.x"
        for package, series in TESTED_SERIES.items()
        if not version(package).startswith(f"{series}.")
    ]
    found += [
        f"{name.owner.replace(':', '.')}.{name.name} (used by {name.used_by}) is gone"
        for name in names
        if not name.present()
    ]
    return found


def check(mode: str, names: tuple[PrivateName, ...] | None = None) -> None:
    """Stop here, naming what changed, if inferq's mode of Celery cannot run on what is installed.

    `names`: what to look for (default: `PRIVATE_NAMES`, looked up once per process). The stock
    mode uses only Celery's public API and runs on any version.
    """
    if mode == "stock":
        return
    found = _installed_problems() if names is None else problems(names)
    if found:
        raise UntestedCeleryError(
            "inferq's Celery adaptations cannot run on the installed Celery/kombu: "
            + "; ".join(found)
            + ". Install the pinned versions (pip install -e . -c constraints.txt), "
            "or set INFERQ_CELERY_MODE=stock to run on Celery's public API alone."
        )


class RunJobMessages:
    """`run_job` messages for the Redis broker, made as Celery makes them, minus its per-call work.

    `send_task` spends 150-300 µs a message (routing, option merging, signals, kombu's publish
    path) on a message whose only parts that vary are the job id, two random ids and the
    headers. This asks Celery for the message once and fills in those parts per job: the worker
    receives what `send_task` would have sent (a test compares the two on a real Redis). The
    messages go out as one LPUSH per queue, in order, so they are taken first in, first out
    like Celery's.
    """

    def __init__(self, app: Celery, task_name: str) -> None:
        template = app.amqp.as_task_v2("", task_name, args=[""], ignore_result=None)
        self._headers: dict[str, Any] = dict(template.headers)
        self._embed = template.body[2]
        self._reply_to = str(app.thread_oid)
        self._client = sync_client(
            str(app.conf.inferq_redis_url), socket_connect_timeout=2, socket_timeout=10
        )

    def message(self, job_id: str, queue: str, headers: dict[str, str]) -> bytes:
        """The message that runs `job_id`, serialized as kombu's Redis transport stores it."""
        task_id = str(uuid.uuid4())
        body = json.dumps([[job_id], {}, self._embed]).encode()
        envelope = {
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {
                **self._headers,
                "id": task_id,
                "root_id": task_id,
                "argsrepr": repr([job_id]),
                **headers,
            },
            "properties": {
                "correlation_id": task_id,
                "reply_to": self._reply_to,
                "delivery_mode": 2,
                "delivery_info": {"exchange": "", "routing_key": queue},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },
        }
        return json.dumps(envelope).encode()

    def push(self, job_ids: list[str], queues: list[str], headers: list[dict[str, str]]) -> None:
        """Put each job's message on its queue, one LPUSH per queue, then the tokens that wake
        waiting workers (`core.queue.wake`), all in one round trip."""
        by_queue: dict[str, list[bytes]] = defaultdict(list)
        for job_id, queue, extra in zip(job_ids, queues, headers, strict=True):
            by_queue[queue].append(self.message(job_id, queue, extra))
        pipe = self._client.pipeline(transaction=False)
        for queue, messages in by_queue.items():
            for start in range(0, len(messages), PUBLISH_BATCH):
                pipe.lpush(queue, *messages[start : start + PUBLISH_BATCH])
        push_wakes(pipe, {queue: len(messages) for queue, messages in by_queue.items()})
        pipe.execute()

    def wake(self, queues: list[str]) -> None:
        """Wake waiting workers for messages Celery itself sent to `queues`, one per message."""
        pipe = self._client.pipeline(transaction=False)
        push_wakes(pipe, Counter(queues))
        pipe.execute()


@lru_cache(maxsize=1)
def _installed_problems() -> list[str]:
    return problems()


@lru_cache(maxsize=8)
def run_job_messages(app: Celery, task_name: str) -> RunJobMessages:
    """The app's message maker (and its Redis client), made on first use."""
    return RunJobMessages(app, task_name)
