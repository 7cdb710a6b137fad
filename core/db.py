"""Database engine and sessions, with SQLite tuned for a writer in each of several processes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

from core.models import SCHEMA_REVISION

POOL_SIZE = 20
POOL_OVERFLOW = 20
"""Connections a process keeps open, and how many more it may open at a busy moment."""

IDLE_TRANSACTION_TIMEOUT_MS = 10_000
"""PostgreSQL ends a session of inferq's left idle inside a transaction this long, rolling it
back. No inferq transaction waits between its statements; one that does lost its process, or
the network to it: a worker cut off from the database between an UPDATE and its COMMIT held the
row locks of its jobs, and the worker that took them over waited for those locks (40 s, until
the connection broke, in tests/integration/test_multi_host.py; over a real partition, until TCP
gives up, hours by default)."""

POSTGRES_CONNECT_ARGS = {
    "options": f"-c idle_in_transaction_session_timeout={IDLE_TRANSACTION_TIMEOUT_MS}",
    # This side of a connection to a server that vanished finds out within about half a
    # minute, not when the host's TCP does (two hours by default).
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite gets WAL and a busy timeout so API and workers can both write."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # A pool as large as PostgreSQL's: with SQLAlchemy's default of 5 (+10 overflow), the
        # API's request threads opened and closed a connection (and ran the pragmas below) for
        # most requests under load.
        engine = create_engine(
            url,
            connect_args={"timeout": 30, "check_same_thread": False},
            pool_size=POOL_SIZE,
            max_overflow=POOL_OVERFLOW,
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    return create_engine(
        url,
        pool_size=POOL_SIZE,
        max_overflow=POOL_OVERFLOW,
        pool_pre_ping=True,
        connect_args=POSTGRES_CONNECT_ARGS if url.startswith("postgresql") else {},
    )


@lru_cache
def engine_for(url: str) -> Engine:
    """One engine per URL per process."""
    return make_engine(url)


class Database:
    """Sessions on one database; passed to whoever needs storage."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = engine_for(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits on success and rolls back on error."""
        with self._sessions() as session:
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise

    def ping(self) -> None:
        """Raise if the database cannot be reached."""
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def schema_revision(self) -> str | None:
        """The Alembic revision the database is at, or None before the first migration."""
        with self.engine.connect() as conn:
            try:
                row = conn.execute(text("SELECT version_num FROM alembic_version")).first()
            except Exception:  # the table does not exist yet
                return None
        return row[0] if row else None

    def is_current(self) -> bool:
        """Whether the database schema matches this code's migrations."""
        return self.schema_revision() == SCHEMA_REVISION
