"""The database engine: SQLite tuned for several processes, each with many request threads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import event, text

from core.db import make_engine


def test_sqlite_connections_are_kept_for_the_next_requests(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'inferq.db'}")
    opened: list[Any] = []
    event.listen(engine, "connect", lambda connection, _record: opened.append(connection))
    for _ in range(2):  # two bursts of 12 requests at once, as the API's threads make them
        connections = [engine.connect() for _ in range(12)]
        for connection in connections:
            assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            connection.close()
    # The second burst reused the first's connections: none was closed and reopened.
    assert len(opened) == 12
