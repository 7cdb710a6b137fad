"""Stored files (OpenAI's /v1/files): uploads and the files batches write; scoped by owner."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import and_, delete, or_, select
from sqlalchemy.orm import defer

from core.db import Database
from core.models import StoredFile, utcnow


def new_file_id() -> str:
    """A fresh, unguessable file id, as OpenAI spells them: `file-…`."""
    return f"file-{uuid.uuid4().hex}"


def new_stored_file(
    owner: str, purpose: str, filename: str, content: bytes, created_at: datetime | None = None
) -> StoredFile:
    """A file row, not yet stored."""
    return StoredFile(
        id=new_file_id(),
        owner=owner,
        purpose=purpose,
        filename=filename,
        size_bytes=len(content),
        content=content,
        created_at=created_at or utcnow(),
    )


class FileStore:
    """Reads and writes file rows; another owner's file is as absent as a missing one."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def add(self, stored: StoredFile) -> StoredFile:
        """Store a file row."""
        with self.db.session() as session:
            session.add(stored)
        return stored

    def get(self, file_id: str, owner: str, *, content: bool = False) -> StoredFile | None:
        """The file (with its bytes only if `content`), or None if missing or someone else's."""
        query = select(StoredFile).where(StoredFile.id == file_id, StoredFile.owner == owner)
        if not content:
            query = query.options(defer(StoredFile.content))
        with self.db.session() as session:
            return session.scalars(query).first()

    def list_for_owner(
        self,
        owner: str,
        *,
        limit: int,
        purpose: str | None = None,
        after: StoredFile | None = None,
        newest_first: bool = True,
    ) -> list[StoredFile]:
        """The owner's files without their bytes, in creation order, strictly past `after`."""
        query = (
            select(StoredFile).options(defer(StoredFile.content)).where(StoredFile.owner == owner)
        )
        if purpose is not None:
            query = query.where(StoredFile.purpose == purpose)
        created, file_id = StoredFile.created_at, StoredFile.id
        if after is not None:
            if newest_first:
                past = or_(
                    created < after.created_at,
                    and_(created == after.created_at, file_id < after.id),
                )
            else:
                past = or_(
                    created > after.created_at,
                    and_(created == after.created_at, file_id > after.id),
                )
            query = query.where(past)
        order = (created.desc(), file_id.desc()) if newest_first else (created, file_id)
        with self.db.session() as session:
            return list(session.scalars(query.order_by(*order).limit(limit)))

    def delete(self, file_id: str, owner: str) -> bool:
        """Delete the owner's file; False if there was none."""
        with self.db.session() as session:
            result = session.execute(
                delete(StoredFile).where(StoredFile.id == file_id, StoredFile.owner == owner)
            )
            return bool(result.rowcount)  # type: ignore[attr-defined]
