"""Reading INFERQ_REDIS_URL: one server, or Redis Sentinel's service (core.redisconn)."""

from __future__ import annotations

import pytest

from core.redisconn import SentinelUrl, celery_broker, parse_sentinel


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
