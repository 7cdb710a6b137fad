"""Prefix routing's pure parts: keys, the rendezvous choice, held entries."""

from __future__ import annotations

from collections import Counter

from core.queue.dispatch import QueuedJob, _parse
from core.queue.routing import pick_worker, prefix_key
from core.tiers import Tier


def test_only_prompts_at_least_the_threshold_long_get_a_key() -> None:
    assert prefix_key("x" * 99, 100) is None
    assert prefix_key("x" * 100, 0) is None
    assert prefix_key("x" * 100, 100) == prefix_key("x" * 100 + "anything after", 100)
    assert prefix_key("x" * 100, 100) != prefix_key("y" + "x" * 99, 100)


def test_keys_spread_over_workers_and_only_a_lost_workers_keys_move() -> None:
    workers = ["gpu0@a", "gpu1@a", "gpu0@b", "gpu1@b"]
    routes = [prefix_key(f"document {n} " * 20, 64) or "" for n in range(400)]
    before = {route: pick_worker(route, workers) for route in routes}
    assert min(Counter(before.values()).values()) > 50  # no worker left out
    after = {route: pick_worker(route, workers[:3]) for route in routes}
    moved = {route for route in routes if before[route] != after[route]}
    assert moved == {route for route in routes if before[route] == "gpu1@b"}
    assert pick_worker("any", []) is None


def test_held_entries_keep_the_route() -> None:
    routed = QueuedJob("job_1", "basic", "alice", 1700000000.25, route="00ff")
    plain = QueuedJob("job_2", "basic", "alice", 1700000000.5)
    assert _parse(routed.entry(), Tier.BASIC, None).route == "00ff"
    assert _parse(plain.entry().encode(), Tier.BASIC, None).route is None
    assert _parse(plain.entry(), Tier.BASIC, None).enqueued_at == 1700000000.5
    assert _parse(plain.entry(), Tier.BASIC, "small").model == "small"  # a lane's held list
