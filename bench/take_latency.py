"""How soon an idle worker's channel gets a job: Celery's BRPOP against inferq's wake-up lists.

inferq's workers never pop a queue to wait (a popped message is on no list in Redis until the
worker records it, and is lost with the reply): they wait by BLPOP on wake-up lists and take by
a script that pops and records at once (`workers.edge`, `core.queue.wake`). This measures what
that costs an idle worker, in one run, on a `redis-server` of the benchmark's own: a consumer
on each transport (kombu's stock Redis transport, which Celery's workers use, and inferq's),
prefetch 32, waiting on one queue; a publisher puts `--jobs` messages on it one at a time, each
after a random pause of 20 to 80 ms so that the consumer is waiting every time, the way the API
sends a job (one pipeline: the message, and for inferq its wake-up token). Reported per
transport: the time from the publisher's send to the consumer's callback (p50, p95, max), the
Redis commands per job, and the commands an idle consumer sends a second.

Run: `.venv/bin/python bench/take_latency.py [--jobs 300]`.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import redis
from kombu import Connection, Consumer, Exchange, Queue
from report import machine_info, percentile, write_report

from core.queue.wake import push_wakes
from workers.edge import EdgeBatchingTransport

REPO_ROOT = Path(__file__).resolve().parents[1]

QUEUE = "inferq.premium"
TRANSPORTS: dict[str, Any] = {"Celery's BRPOP": "redis", "inferq take": EdgeBatchingTransport}


@contextmanager
def redis_of_its_own() -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="inferq-take-") as data:
        server = subprocess.Popen(
            [
                *(shutil.which("redis-server") or "redis-server", "--port", str(port)),
                *("--save", "", "--appendonly", "no", "--dir", data),
            ],
            stdout=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        try:
            client = redis.Redis.from_url(url)
            for _ in range(100):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            yield url
        finally:
            server.terminate()
            server.wait()


def _calls(client: redis.Redis) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    return sum(int(value["calls"]) for value in stats.values())


def measure(url: str, transport: Any, jobs: int, wakes: bool) -> dict[str, Any]:
    """One consumer on `transport`, idle between `jobs` messages published one at a time."""
    client = redis.Redis.from_url(url)
    client.flushdb()
    sent: dict[str, float] = {}
    waits: list[float] = []
    stop = threading.Event()
    queue = Queue(QUEUE, Exchange(QUEUE), routing_key=QUEUE)

    def on_message(body: Any, message: Any) -> None:
        waits.append(time.perf_counter() - sent[body["id"]])
        message.ack()

    def consume() -> None:
        with Connection(url, transport=transport) as connection:
            channel = connection.default_channel
            channel.basic_qos(0, 32, False)
            with Consumer(channel, [queue], callbacks=[on_message]):
                while not stop.is_set():
                    with suppress(TimeoutError):
                        connection.drain_events(timeout=0.5)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    time.sleep(1.0)
    idle_before = _calls(client)
    time.sleep(5.0)
    idle_per_s = (_calls(client) - idle_before - 1) / 5.0
    before = _calls(client)
    for _ in range(jobs):
        time.sleep(random.uniform(0.02, 0.08))
        job = str(uuid.uuid4())
        envelope = {
            "body": json.dumps({"id": job}),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {},
            "properties": {
                "delivery_info": {"exchange": "", "routing_key": QUEUE},
                "delivery_tag": str(uuid.uuid4()),
                "priority": 0,
                "body_encoding": "utf-8",
            },
        }
        pipe = client.pipeline(transaction=False)
        pipe.lpush(QUEUE, json.dumps(envelope))
        if wakes:
            push_wakes(pipe, {QUEUE: 1})
        sent[job] = time.perf_counter()
        pipe.execute()
    deadline = time.monotonic() + 30
    while len(waits) < jobs and time.monotonic() < deadline:
        time.sleep(0.05)
    per_job = (_calls(client) - before) / jobs
    stop.set()
    consumer.join(timeout=5)
    ms = [wait * 1000 for wait in waits]
    return {
        "received": len(waits),
        "wait_p50_ms": round(percentile(ms, 50), 2),
        "wait_p95_ms": round(percentile(ms, 95), 2),
        "wait_max_ms": round(max(ms), 2),
        "redis_commands_per_job": round(per_job, 1),
        "idle_commands_per_s": round(idle_per_s, 1),
    }


def save_chart(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.35
    for offset, key, name in (
        (-width / 2, "wait_p50_ms", "p50"),
        (width / 2, "wait_p95_ms", "p95"),
    ):
        ax.bar(
            [i + offset for i in range(len(labels))],
            [results[label][key] for label in labels],
            width,
            label=name,
        )
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("publish → delivery, ms")
    ax.set_title("An idle consumer gets a job")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args()
    machine = machine_info()
    results: dict[str, dict[str, Any]] = {}
    with redis_of_its_own() as url:
        for label, transport in TRANSPORTS.items():
            results[label] = measure(url, transport, args.jobs, wakes=transport != "redis")
            print(f"{label}: {results[label]}", flush=True)
    print(
        f"\n{'transport':<16}{'p50 ms':>8}{'p95 ms':>8}{'max ms':>8}{'cmds/job':>10}{'idle/s':>8}"
    )
    for label, r in results.items():
        print(
            f"{label:<16}{r['wait_p50_ms']:>8}{r['wait_p95_ms']:>8}{r['wait_max_ms']:>8}"
            f"{r['redis_commands_per_job']:>10}{r['idle_commands_per_s']:>8}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    chart = args.out / "take_latency.png"
    save_chart(results, chart)
    workload = vars(args) | {"out": str(args.out)}
    model = {"name": "none: the transports alone"}
    write_report(args.out / "take_latency.json", chart, machine, model, workload, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
