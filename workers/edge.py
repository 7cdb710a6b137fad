"""Edge batching: a worker with free slots takes many waiting jobs in one Redis round trip.

Celery's Redis transport takes one message per BRPOP, so a worker that frees 32 slots while
the queues hold hundreds of jobs makes 32 round trips (plus one each to record the message as
unacknowledged) before its engine has them all. `EdgeBatchingTransport` takes only by one Lua
script (`workers.take`): up to as many messages as the worker has free slots for (Celery's
prefetch limit, at most `edge_batch`), from the queues in polling order: premium before
standard before basic, a worker's own queue before the shared one. A queued premium job is
therefore never passed over for a basic one.

The take pops the messages *and* records them as unacknowledged in the same atomic step, so the
jobs of a worker that dies right after, or whose connection drops before the reply reaches it,
are still handed on (by the scheduler, `core.queue.unstarted`). A BRPOP cannot do that: the
message it pops is on no list in Redis until the worker records it in a second round trip, and
is lost if the reply or the worker is. So the channel never pops to wait. While the last take
found messages it takes again at once; once a take comes back empty it waits, by BLPOP on the
wake-up lists of its queues (`core.queue.wake`), for a token or the wait's end (0.25 s), and
takes then.

The channel also counts the jobs the worker still holds from an earlier connection. After a
reconnect, kombu's new channel has no unacknowledged messages of its own, and Celery restores
the full prefetch limit because its own list of running tasks is empty (the worker's direct
strategy hands jobs to the runner, not to Celery's requests): the worker would take a full
batch more while its engine still ran the jobs taken before the connection dropped, holding
jobs that another worker could start. With `jobs_held` (a transport option: how many jobs the
worker has taken and not yet ended), the limit applies to those as well.

The channel also keeps one Redis client for its short commands. The stock channel builds a
new redis-py client object for every message it records, every ack and every event it sends
(`conn_or_acquire`), about a sixth of the consumer thread's CPU in a 256-job run; the client is
thread-safe over the channel's pool and is rebuilt when kombu replaces the pool.

Acknowledgements are sent together. The stock QoS removes each acked message from the unacked
hash and its index in a round trip of its own, on the consumer's event loop, where Celery runs
them one after another (a job's end is handed to that loop to ack); in a 256-job run that was
about a third of the consumer thread's samples. Once the transport runs on an event loop, an
ack frees the worker's slot at once and its removal waits for the end of the loop's turn, when
one ZREM and one HDEL remove every message acked in that turn. A worker killed in between
leaves those messages unacknowledged in Redis, as one killed before acking would: the
visibility restore returns them, and the worker that takes them skips their final jobs.

With a `tier_reserve` (a transport option, `workers.reserve.TierReserve`), the channel takes
from a tier's queues only while the tier has room in the worker: it waits on those queues'
wake-up lists alone, and the take stops at each tier's room. The reserve counts every message the
transport delivers, by the tier of the queue it was sent to, until it is acknowledged.

Only the worker uses this transport; everything else publishes through the stock one, and the
messages are the same. Under kombu's `global_keyprefix`, which inferq does not set, the channel
waits and takes by kombu's own BRPOP, as the take script does not prefix its keys.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from queue import Empty
from typing import Any

import redis
from kombu.transport import redis as redis_transport
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from core import keys
from core.metrics import JOBS_TAKEN_IN_BULK
from workers.reserve import TierReserve
from workers.take import take_command

log = logging.getLogger(__name__)

_BROKER_GONE = (AttributeError, redis.RedisError)
"""What kombu's Redis channel raises once its connection is lost or closed under it."""


class EdgeBatchingQoS(redis_transport.QoS):
    """Skips the unacked bookkeeping round trip for messages the take script recorded, and
    counts the jobs the worker holds from earlier connections against the prefetch limit.

    It also survives losing Redis. When the connection drops, kombu closes the channel; it
    then restores the channel's unacknowledged messages, and later acks the messages of tasks
    that were running, through that closed channel, whose connection has no server
    (ConnectionError) or is gone (AttributeError); the stock QoS lets that end the worker. Here
    such a message stays recorded as unacknowledged in Redis: the visibility restore returns it,
    and the worker skips it then, its job being final or claimed (if Redis lost it, the
    scheduler sends its job again if still queued).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._acked: list[str] = []
        self._acked_lock = threading.Lock()

    def append(self, message: Any, delivery_tag: str) -> None:
        recorded: set[str] = self.channel.recorded_tags
        if delivery_tag in recorded:
            recorded.discard(delivery_tag)
            virtual.QoS.append(self, message, delivery_tag)
            return
        super().append(message, delivery_tag)

    def can_consume(self) -> bool:
        limit: int = self.prefetch_count
        if not limit:  # not the tasks' channel (remote control's, say): never held back
            return True
        reserve: TierReserve | None = self.channel.tier_reserve
        if reserve is not None:  # a tier with room; the top one counts only its own jobs
            return any(room > 0 for room in reserve.left().values())
        return self._held() < limit

    def can_consume_max_estimate(self) -> int | None:
        limit: int = self.prefetch_count
        return max(limit - self._held(), 0) if limit else None

    def _held(self) -> int:
        """Messages taken and not yet acknowledged: this channel's, or the worker's jobs
        (which include those of channels closed since), whichever is more."""
        own: int = len(self._delivered) - len(self._dirty)
        jobs_held: Callable[[], int] | None = self.channel.jobs_held
        return own if jobs_held is None else max(own, jobs_held())

    def restore_unacked(self, client: Any = None) -> Any:
        # The tier reserve keeps counting these: their jobs still run in the engine, and end
        # (acked through this closed channel) when they are done.
        try:
            return super().restore_unacked(client)
        except _BROKER_GONE as exc:
            log.warning("could not restore %d messages: %r", len(self._delivered), exc)
            self._delivered.clear()
            return None

    def ack(self, delivery_tag: str) -> None:
        if self.channel.tier_reserve is not None:
            self.channel.tier_reserve.ended(delivery_tag)
        # A closed channel has no connection: the stock path below handles its acks.
        if getattr(self.channel.connection, "acks_deferred", False):
            virtual.QoS.ack(self, delivery_tag)  # the slot is free now; Redis hears at turn's end
            with self._acked_lock:
                self._acked.append(delivery_tag)
            return
        try:
            super().ack(delivery_tag)
        except _BROKER_GONE as exc:
            log.warning(
                "could not ack message %s, left to the visibility restore: %r", delivery_tag, exc
            )
            virtual.QoS.ack(self, delivery_tag)

    def flush_acks(self) -> None:
        """Remove the messages acked since the last flush from Redis, in one round trip."""
        with self._acked_lock:
            tags, self._acked = self._acked, []
        if not tags:
            return
        try:
            with self.channel.conn_or_acquire() as client:
                pipe = client.pipeline()  # MULTI/EXEC, like the stock ack
                pipe.zrem(self.unacked_index_key, *tags).hdel(self.unacked_key, *tags)
                pipe.execute()
        except _BROKER_GONE as exc:
            log.warning(
                "could not ack %d messages, left to the visibility restore: %r", len(tags), exc
            )

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if self.channel.tier_reserve is not None:
            self.channel.tier_reserve.ended(delivery_tag)
        try:
            super().reject(delivery_tag, requeue=requeue)
        except _BROKER_GONE as exc:
            log.warning(
                "could not reject message %s, left to the visibility restore: %r", delivery_tag, exc
            )
            virtual.QoS.ack(self, delivery_tag)


class _TierGatedCycle:
    """The channel's queue cycle, less the queues of tiers that have no room in the worker."""

    def __init__(self, cycle: Any, reserve: TierReserve) -> None:
        self._cycle = cycle
        self._reserve = reserve

    def update(self, queues: Any) -> None:
        self._cycle.update(queues)

    def rotate(self, last_used: Any) -> Any:
        return self._cycle.rotate(last_used)

    def consume(self, n: int) -> list[str]:
        rooms = self._reserve.left()
        queues: list[str] = self._cycle.consume(n)
        return [q for q in queues if rooms.get(keys.tier_of_queue(q), 1) > 0]  # type: ignore[arg-type]


class JobsHeld:
    """The `jobs_held` transport option: how many jobs the worker holds, asked when called.

    Celery's remote control sends the transport options back as JSON (`celery inspect stats`,
    which Flower's worker page reads), so this gives its current count there; a bare bound
    method cannot be encoded and made the whole reply fail.
    """

    def __init__(self, count: Callable[[], int]) -> None:
        self._count = count

    def __call__(self) -> int:
        return self._count()

    def __json__(self) -> int:
        return self._count()


class EdgeBatchingChannel(redis_transport.Channel):
    """A Redis channel that takes only by the take script, and waits on wake-up lists (see the
    module docstring)."""

    QoS = EdgeBatchingQoS
    edge_batch = 32
    jobs_held: Callable[[], int] | None = None
    tier_reserve: TierReserve | None = None
    # Options more than the stock channel reads from `broker_transport_options`.
    from_transport_options = (  # type: ignore[assignment]
        *redis_transport.Channel.from_transport_options,
        "edge_batch",
        "jobs_held",
        "tier_reserve",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.recorded_tags: set[str] = set()
        super().__init__(*args, **kwargs)
        if self.tier_reserve is not None:
            self._queue_cycle = _TierGatedCycle(self._queue_cycle, self.tier_reserve)
        self._short_client: Any = None
        self._sent = "BLPOP"
        """The command whose reply the channel's connection owes: BLPOP (wait) or EVAL (take)."""
        self._take_next = True
        """Whether the queues may hold messages now: the next command is a take, not a wait."""

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """The given client, else the channel's one client for short commands (see above)."""
        if client:
            yield client
            return
        pool = self.pool  # a new one after kombu drops the old pools on a lost connection
        if self._short_client is None or self._short_client.connection_pool is not pool:
            self._short_client = self._create_client()
        yield self._short_client

    def close(self) -> None:
        if self._qos is not None and not self.closed:
            self._qos.flush_acks()
        super().close()

    def _brpop_start(self, timeout: float | None = None) -> None:
        if self.global_keyprefix:  # keys the take script would not prefix: kombu's own BRPOP
            super()._brpop_start(timeout)
            return
        queues: list[str] = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        command = self._take_command(queues) if self._take_next else None
        if command is None:
            wait = self.brpop_timeout if timeout is None else timeout
            command = ["BLPOP", *(keys.queue_wake(queue) for queue in queues), wait or 0]
        self._sent = str(command[0])
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()  # type: ignore[assignment]  # kombu: None
        self.client.connection.send_command(*command)

    def _brpop_read(self, **options: Any) -> bool:
        if self.global_keyprefix:
            return bool(super()._brpop_read(**options))
        try:
            try:
                reply = self.client.parse_response(self.client.connection, self._sent, **options)
            except self.connection_errors:
                # Disconnected, the next poll reconnects. A take whose reply was lost here
                # left its messages recorded as unacknowledged: the handoff puts them back.
                self.client.connection.disconnect()
                raise
            # After a wait, a token or the wait's end: take now either way, so a message that
            # came without a token, or a tier given room since, waits no longer than the wait.
            taken = (reply or []) if self._sent == "EVAL" else self._take_now()
            self._take_next = bool(taken)
            if not taken:
                raise Empty()
            self._deliver_taken(taken)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]  # as kombu's own read does
            self._flush_brpop_reauth()

    def _poll_error(self, type: str, **options: Any) -> None:
        # kombu reads the pending reply as a BRPOP's and drops it: read it as what was sent, so
        # a take's messages are delivered rather than left to the handoff.
        if type != "BRPOP" or self.global_keyprefix or not self._in_poll:
            super()._poll_error(type, **options)
            return
        with suppress(Empty):
            self._brpop_read(**options)

    def _take_now(self) -> list[Any]:
        """Take on the channel's short client, while its own connection is idle."""
        command = self._take_command(self._queue_cycle.consume(len(self.active_queues)))
        if command is None:
            return []
        with self.conn_or_acquire() as client:
            return list(client.execute_command(*command) or [])

    def _take_command(self, queues: list[str]) -> list[Any] | None:
        """The take of up to as many messages as the worker has room for, from `queues` in
        polling order; None when it has room for none."""
        if self.tier_reserve is not None:
            rooms = self.tier_reserve.left()
            free: int | None = sum(rooms.values())
        else:
            rooms, free = {}, self.qos.can_consume_max_estimate()
        want = self.edge_batch if free is None else min(self.edge_batch, free)
        if want <= 0 or not queues:
            return None
        return take_command(
            [(self._q_for_pri(q, pri), q) for pri in self.priority_steps for q in queues],
            (self.unacked_key, self.unacked_index_key),
            want,
            rooms,
        )

    def _deliver_taken(self, taken: list[Any]) -> None:
        JOBS_TAKEN_IN_BULK.inc(len(taken) // 2 - 1)
        self._queue_cycle.rotate(bytes_to_str(taken[0]).rsplit(self.sep, 1)[0])
        for index in range(0, len(taken), 2):
            queue = bytes_to_str(taken[index]).rsplit(self.sep, 1)[0]
            payload = loads(bytes_to_str(taken[index + 1]))
            tag = payload.get("properties", {}).get("delivery_tag")
            if tag:
                self.recorded_tags.add(tag)
            self.connection._deliver(payload, queue)


class EdgeBatchingTransport(redis_transport.Transport):
    """Celery's Redis transport with edge batching; `broker_transport` of the worker's app."""

    Channel = EdgeBatchingChannel
    # A channel's wait covers the queues of the tiers with room when it is sent and ends in a
    # take: renewed this often (kombu: every second; its channels copy it), a tier given room
    # since, or a message that came without a token, waits little.
    brpop_timeout = 0.25  # type: ignore[assignment]  # kombu: an int
    acks_deferred = False
    """Whether acks wait for the end of the event loop's turn (once registered with a loop)."""

    def _deliver(self, message: Any, queue: str) -> None:
        # Counted against its job's tier from now until it is acknowledged: the tier of the
        # queue it was sent to (an aged job the scheduler moved to the premium queue still
        # counts as its own tier, as it runs at its own priority in the engine).
        options = self.client.transport_options if self.client is not None else {}
        reserve: TierReserve | None = options.get("tier_reserve")
        if reserve is not None and isinstance(message, dict):
            properties = message.get("properties") or {}
            sent_to = (properties.get("delivery_info") or {}).get("routing_key") or queue
            tier = keys.tier_of_queue(sent_to) or keys.tier_of_queue(queue)
            tag = properties.get("delivery_tag")
            if tag and tier is not None:
                reserve.taken(tag, tier)
        super()._deliver(message, queue)

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        loop.on_tick.add(self.flush_acks)
        self.acks_deferred = True

    def flush_acks(self) -> None:
        """Send the acks of every channel made in this turn of the event loop."""
        for channel in list(self.channels):
            if isinstance(channel, EdgeBatchingChannel) and channel._qos is not None:
                channel._qos.flush_acks()


class EdgeBatchingSentinelChannel(EdgeBatchingChannel, redis_transport.SentinelChannel):
    """The edge-batching channel on the primary that Redis Sentinel names (`core.redisconn`)."""

    from_transport_options = (  # type: ignore[assignment]
        *EdgeBatchingChannel.from_transport_options,
        *redis_transport.SentinelChannel.from_transport_options,
    )


class EdgeBatchingSentinelTransport(EdgeBatchingTransport):
    """`EdgeBatchingTransport` through Redis Sentinel, for an `INFERQ_REDIS_URL` that names one."""

    Channel = EdgeBatchingSentinelChannel
    default_port = redis_transport.SentinelTransport.default_port  # type: ignore[assignment]
