"""API keys: random, shown once, stored only as a SHA-256 hash."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select

from core.db import Database
from core.models import ApiKey, utcnow
from core.tiers import Tier

KEY_PREFIX = "iq_"


def hash_key(key: str) -> str:
    """The stored form of a key; keys carry 256 random bits, so a fast hash is enough."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Quota:
    """A key's limits; None: no limit of that kind."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    @property
    def unlimited(self) -> bool:
        """True when the key has no limit at all."""
        return self == Quota()


@dataclass(frozen=True)
class Principal:
    """Who a request acts for."""

    owner: str
    tier: Tier
    key_id: int
    quota: Quota = Quota()


class KeyStore:
    """Creates, checks, lists and revokes API keys."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, owner: str, tier: Tier, quota: Quota | None = None) -> tuple[str, ApiKey]:
        """A new key for `owner`; the plaintext is returned here and never stored."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        quota = quota or Quota()
        record = ApiKey(
            key_hash=hash_key(key),
            prefix=key[: len(KEY_PREFIX) + 6],
            owner=owner,
            tier=tier.value,
            created_at=utcnow(),
            requests_per_minute=quota.requests_per_minute,
            tokens_per_minute=quota.tokens_per_minute,
            max_concurrent=quota.max_concurrent,
        )
        with self.db.session() as session:
            session.add(record)
        return key, record

    def authenticate(self, key: str) -> Principal | None:
        """The principal for a live key, or None for an unknown or revoked one."""
        with self.db.session() as session:
            record = session.scalars(select(ApiKey).where(ApiKey.key_hash == hash_key(key))).first()
        if record is None or record.revoked_at is not None:
            return None
        return Principal(
            owner=record.owner, tier=Tier(record.tier), key_id=record.id, quota=quota_of(record)
        )

    def list(self, owner: str | None = None) -> list[ApiKey]:
        """All keys (or one owner's), oldest first."""
        query = select(ApiKey).order_by(ApiKey.id)
        if owner is not None:
            query = query.where(ApiKey.owner == owner)
        with self.db.session() as session:
            return list(session.scalars(query))

    def revoke(self, key_id: int) -> bool:
        """Revoke a key by id; False if there is no such live key."""
        with self.db.session() as session:
            record = session.get(ApiKey, key_id)
            if record is None or record.revoked_at is not None:
                return False
            record.revoked_at = utcnow()
        return True


def quota_of(record: ApiKey) -> Quota:
    """A stored key's limits."""
    return Quota(record.requests_per_minute, record.tokens_per_minute, record.max_concurrent)
