"""Migrations: the head matches what the code expects and builds the models' schema."""

from __future__ import annotations

from pathlib import Path

from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from core.db import Database
from core.models import SCHEMA_REVISION, Base
from migrations import alembic_config, upgrade


def test_code_expects_the_latest_migration() -> None:
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    assert script.get_current_head() == SCHEMA_REVISION


def test_upgrade_creates_every_model_table_and_column(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url)
    db = Database(url)
    assert db.is_current()
    inspector = inspect(db.engine)
    for table in Base.metadata.sorted_tables:
        columns = {column["name"] for column in inspector.get_columns(table.name)}
        assert columns == {column.name for column in table.columns}, table.name
