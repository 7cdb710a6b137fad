"""Reading INFERQ_REDIS_URL: one server, or Redis Sentinel's service (core.redisconn)."""

from __future__ import annotations

import pytest
import redis

from core.redisconn import SentinelUrl, celery_broker, parse_sentinel, version_problem


def test_a_server_url_is_not_a_sentinel_one() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://:pw@cache:6380/1", "unix:///run/r.sock"):
        assert parse_sentinel(url) is None
        assert celery_broker(url) == (url, {})


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_database() -> None:
    url = "redis+sentinel://:s%40cret@10.0.0.1:26379,10.0.0.2:26380,sentinel-3/inferq/2"
    assert parse_sentinel(url) == SentinelUrl(
        (("10.0.0.1", 26379), ("10.0.0.2", 26380), ("sentinel-3", 26379)),
        "inferq",
        2,
        None,
        "s@cret",
    )
    broker, options = celery_broker(url)
    assert broker == (
        "sentinel://:s%40cret@10.0.0.1:26379/2;sentinel://:s%40cret@10.0.0.2:26380/2;"
        "sentinel://:s%40cret@sentinel-3:26379/2"
    )
    assert options == {"master_name": "inferq"}
    assert parse_sentinel("redis+sentinel://h:1/svc") == SentinelUrl((("h", 1),), "svc")


@pytest.mark.parametrize(
    "url", ["redis+sentinel://h:1", "redis+sentinel://h:1/svc/0/extra", "redis+sentinel://:1/svc"]
)
def test_a_malformed_sentinel_url_is_refused(url: str) -> None:
    with pytest.raises(ValueError):
        parse_sentinel(url)


class _Server:
    """Answers INFO server with a version, as a Redis server would."""

    def __init__(self, version: str) -> None:
        self.version = version

    def info(self, section: str) -> dict[str, str]:
        assert section == "server"
        return {"redis_version": self.version}


@pytest.mark.parametrize(
    ("version", "refused"),
    [("6.2.14", True), ("5.0.7", True), ("7.0.0", False), ("7.0.15", False), ("7.4.1", False)],
)
def test_a_redis_older_than_7_0_is_named_as_too_old(version: str, refused: bool) -> None:
    problem = version_problem(_Server(version))  # type: ignore[arg-type]
    assert (problem is not None) == refused
    if problem:
        assert "7.0" in problem and version in problem


def test_an_unreachable_redis_is_left_to_the_callers_outage_handling() -> None:
    assert version_problem(redis.Redis(port=1, socket_connect_timeout=1)) is None
