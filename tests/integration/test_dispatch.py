"""The dispatcher on a Redis of its own: idle, it blocks instead of polling; a held job wakes it;
a group of jobs goes to Redis in one round trip, as the messages Celery itself would send."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
import redis.asyncio as aioredis

from core import keys
from core.queue.app import RUN_JOB_TASK, enqueue_job, enqueue_jobs, make_celery_app
from core.queue.dispatch import Dispatcher, QueuedJob
from core.queue.held import drop_held
from core.settings import Settings
from core.tiers import Tier
from tests.support import command_calls, redis_server


@contextmanager
def running_dispatcher(dispatcher: Dispatcher, idle_s: float) -> Iterator[None]:
    """`dispatcher.run` in a thread for the block; stopped (and woken) on the way out."""
    stopped = threading.Event()
    thread = threading.Thread(
        target=dispatcher.run, args=(stopped,), kwargs={"idle_s": idle_s}, daemon=True
    )
    thread.start()
    try:
        yield
    finally:
        stopped.set()
        dispatcher.redis.lpush(keys.DISPATCH_WAKE, "1")
        thread.join(timeout=10)
        assert not thread.is_alive()


def _commands_processed(client: redis.Redis) -> int:
    return int(client.info("stats")["total_commands_processed"])


def test_an_idle_dispatcher_blocks_instead_of_polling_redis(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        settings = Settings(redis_url=server.url, data_dir=tmp_path)
        client = redis.Redis.from_url(server.url)
        dispatcher = Dispatcher(settings, client, make_celery_app(settings))
        with running_dispatcher(dispatcher, idle_s=0.5):
            time.sleep(0.5)
            before = _commands_processed(client)
            time.sleep(3)
            used = _commands_processed(client) - before
        # Every half second: the three tiers' takes, the held counts, aging and reclaim (about
        # ten commands). Polling every 20 ms, as it once did, made over 450 in 3 s.
        assert used < 150, f"{used} Redis commands in 3 s of an idle system"


def test_a_held_job_wakes_the_dispatcher_and_is_sent_once_there_is_room(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        settings = Settings(redis_url=server.url, data_dir=tmp_path, dispatch_backlog=2)
        # A socket timeout past the minute the dispatcher may block for (redis-py's is 5 s).
        client = redis.Redis.from_url(server.url, socket_timeout=120)
        dispatcher = Dispatcher(settings, client, make_celery_app(settings))
        queue = keys.queue_name(Tier.BASIC)
        # Idle for a minute unless woken: only the wake can get the held job sent in time.
        with running_dispatcher(dispatcher, idle_s=60):
            time.sleep(0.5)  # the dispatcher is blocked by now
            dispatcher.submit([QueuedJob(f"job_{i}", Tier.BASIC.value, "owner") for i in range(3)])
            assert client.llen(queue) == 2
            assert dispatcher.held()[Tier.BASIC.value] == 1
            client.rpop(queue)  # a worker takes one message: room for the held job
            deadline = time.monotonic() + 20
            while dispatcher.held()[Tier.BASIC.value] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert dispatcher.held()[Tier.BASIC.value] == 0
            assert client.llen(queue) == 2


def test_a_group_of_jobs_goes_to_redis_in_one_round_trip(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        settings = Settings(redis_url=server.url, data_dir=tmp_path)
        client = redis.Redis.from_url(server.url)
        celery = make_celery_app(settings)
        jobs: list[tuple[str, Tier | str]] = [(f"job-{i}", Tier.BASIC) for i in range(50)]
        jobs.append(("job-premium", Tier.PREMIUM))
        enqueue_jobs(celery, jobs[:1])  # the producer's connection, made outside the count
        before = int(client.info("stats")["total_reads_processed"])
        enqueue_jobs(celery, jobs[1:], headers=[{"n": str(i)} for i in range(1, len(jobs))])
        reads = int(client.info("stats")["total_reads_processed"]) - before
        # One LPUSH round trip per message made 53 reads here. In one pipeline the 50 messages
        # (about 50 KB) take Redis a few reads of at most 16 KB each: 6 on a quiet host, 12 on
        # a busy one, where the bytes arrive in more pieces.
        assert reads <= 25, f"{reads} reads by Redis to enqueue {len(jobs) - 1} jobs"
        basic = [json.loads(m) for m in client.lrange(keys.queue_name(Tier.BASIC), 0, -1)]
        assert [m["headers"]["argsrepr"] for m in reversed(basic)] == [
            f"['job-{i}']" for i in range(50)
        ]
        assert [m["headers"].get("n") for m in reversed(basic)] == [None, *map(str, range(1, 50))]
        [premium] = client.lrange(keys.queue_name(Tier.PREMIUM), 0, -1)
        assert json.loads(premium)["headers"]["argsrepr"] == "['job-premium']"


def test_a_job_message_is_the_one_celery_would_send(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        settings = Settings(redis_url=server.url, data_dir=tmp_path)
        client = redis.Redis.from_url(server.url)
        celery = make_celery_app(settings)
        queue = keys.queue_name(Tier.STANDARD)
        celery.send_task(RUN_JOB_TASK, args=["job-1"], queue=queue, headers={"n": "1"})
        enqueue_job(celery, "job-1", Tier.STANDARD, {"n": "1"})
        # LPUSH puts the newest first; the worker takes from the other end.
        ours, celerys = (json.loads(raw) for raw in client.lrange(queue, 0, -1))
        assert ours.keys() == celerys.keys()
        for message in (ours, celerys):
            body = json.loads(base64.b64decode(message.pop("body")))
            assert body == [
                ["job-1"],
                {},
                {"callbacks": None, "errbacks": None, "chain": None, "chord": None},
            ]
            task_id = message["headers"].pop("id")
            assert message["headers"].pop("root_id") == task_id
            assert message["properties"].pop("correlation_id") == task_id
            message["delivery_tag"] = message["properties"].pop("delivery_tag")
            message["task_id"] = task_id
        # Each message has ids of its own; everything else is the same.
        assert ours.pop("task_id") != celerys.pop("task_id")
        assert ours.pop("delivery_tag") != celerys.pop("delivery_tag")
        assert ours == celerys
        assert ours["headers"]["task"] == RUN_JOB_TASK and ours["headers"]["n"] == "1"


def test_cancelled_held_jobs_leave_their_lists_and_the_others_keep_their_turn(
    tmp_path: Path,
) -> None:
    with redis_server(tmp_path) as server:
        settings = Settings(redis_url=server.url, data_dir=tmp_path, dispatch_backlog=1)
        client = redis.Redis.from_url(server.url)
        dispatcher = Dispatcher(settings, client, make_celery_app(settings))
        basic = Tier.BASIC.value
        dispatcher.submit([QueuedJob(f"a{i}", basic, "alice") for i in range(5)])
        dispatcher.submit([QueuedJob(f"b{i}", basic, "bob") for i in range(2)])
        assert dispatcher.held()[basic] == 6  # a0 went straight onto the queue

        async def drop() -> tuple[int, int, int]:
            aclient = aioredis.Redis.from_url(server.url)
            try:
                return (
                    await drop_held(aclient, basic, "alice", ["a0", "a1", "a3"]),
                    await drop_held(aclient, basic, "bob", ["b0", "b1"]),
                    await drop_held(aclient, basic, "bob", ["b0"]),
                )
            finally:
                await aclient.aclose()

        # a0 was sent already: its message stays, and the worker skips it.
        assert asyncio.run(drop()) == (2, 2, 0)
        assert dispatcher.held()[basic] == 2
        assert client.lrange(keys.held_list(basic, "alice"), 0, -1)[0].startswith(b"a2 ")
        assert client.zrange(keys.held_owners(basic), 0, -1) == [b"alice"]
        client.delete(keys.queue_name(Tier.BASIC))  # a worker took a0
        sent = []
        for _ in range(2):
            dispatcher.release()
            messages = client.lrange(keys.queue_name(Tier.BASIC), 0, -1)
            sent += [json.loads(message)["headers"]["argsrepr"] for message in messages]
            client.delete(keys.queue_name(Tier.BASIC))
        assert sent == ["['a2']", "['a4']"]


def test_held_jobs_are_released_in_equal_shares_of_the_room_a_few_commands_a_share(
    tmp_path: Path,
) -> None:
    """A flood of one owner's jobs costs Redis a command per share of the room, not one per job
    (the scheduler's refill once made about ten a job), and owners still take turns."""
    with redis_server(tmp_path) as server:
        settings = Settings(redis_url=server.url, data_dir=tmp_path, dispatch_backlog=10)
        client = redis.Redis.from_url(server.url)
        dispatcher = Dispatcher(settings, client, make_celery_app(settings))
        basic = Tier.BASIC.value
        queue = keys.queue_name(Tier.BASIC)
        calls = command_calls(client)
        dispatcher.submit([QueuedJob(f"a{i}", basic, "alice") for i in range(30)])
        dispatcher.submit([QueuedJob(f"b{i}", basic, "bob") for i in range(10)])
        held = command_calls(client)
        assert dispatcher.held()[basic] == 30  # a0 to a9 went straight onto the queue
        assert held["rpush"] - calls.get("rpush", 0) == 2  # one per owner, not one per job
        rounds = []
        for _ in range(3):
            client.delete(queue)  # a worker took every message
            before = command_calls(client)
            assert dispatcher.release() == 10
            after = command_calls(client)
            rounds.append(_sent_ids(client, queue))
            assert after["lpop"] - before.get("lpop", 0) <= 3, "a command per share"
            assert after.get("lrem", 0) == before.get("lrem", 0)
        # Five each while both wait; then alice alone.
        assert rounds[0] == [f"a{i}" for i in range(10, 15)] + [f"b{i}" for i in range(5)]
        assert rounds[1] == [f"a{i}" for i in range(15, 20)] + [f"b{i}" for i in range(5, 10)]
        assert rounds[2] == [f"a{i}" for i in range(20, 30)]
        assert dispatcher.held()[basic] == 0
        assert client.scard(keys.dispatching(basic)) == 0  # every sent job unparked
        assert client.zcard(keys.held_owners(basic)) == 0


def test_an_owner_that_runs_short_leaves_its_share_to_the_others_in_equal_parts(
    tmp_path: Path,
) -> None:
    with redis_server(tmp_path) as server:
        settings = Settings(redis_url=server.url, data_dir=tmp_path, dispatch_backlog=30)
        client = redis.Redis.from_url(server.url)
        dispatcher = Dispatcher(settings, client, make_celery_app(settings))
        basic = Tier.BASIC.value
        dispatcher.submit([QueuedJob(f"f{i}", basic, "filler") for i in range(30)])  # the queue
        dispatcher.submit(
            [QueuedJob("a0", basic, "alice")]
            + [
                QueuedJob(f"{owner[0]}{i}", basic, owner)
                for owner in ("bob", "carol")
                for i in range(20)
            ]
        )
        client.delete(keys.queue_name(Tier.BASIC))
        assert dispatcher.release() == 30
        sent = _sent_ids(client, keys.queue_name(Tier.BASIC))
        # Ten each, alice had one; the nine left: four each, then one.
        assert [sum(job.startswith(o) for job in sent) for o in "abc"] == [1, 15, 14]


def test_a_dispatcher_sends_what_an_earlier_one_parked_in_a_list(tmp_path: Path) -> None:
    """Parked jobs were kept in a list before the set: a new dispatcher sends them at start."""
    with redis_server(tmp_path) as server:
        settings = Settings(redis_url=server.url, data_dir=tmp_path)
        client = redis.Redis.from_url(server.url)
        dispatcher = Dispatcher(settings, client, make_celery_app(settings))
        basic = Tier.BASIC.value
        client.rpush(
            keys.dispatching_list(basic),
            *(QueuedJob(f"p{i}", basic, "o").entry() for i in range(3)),
        )
        dispatcher.submit([QueuedJob("new", basic, "o")])  # the API's hold, beside the old list
        assert dispatcher.recover() == 3
        sent = _sent_ids(client, keys.queue_name(Tier.BASIC))
        assert sent[0] == "new" and sorted(sent[1:]) == ["p0", "p1", "p2"]
        assert not client.exists(keys.dispatching_list(basic))


def _sent_ids(client: redis.Redis, queue: str) -> list[str]:
    """The job ids of a queue's messages, oldest first."""
    messages = reversed(client.lrange(queue, 0, -1))
    return [json.loads(message)["headers"]["argsrepr"][2:-2] for message in messages]
