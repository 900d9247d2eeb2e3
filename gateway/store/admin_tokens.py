"""Admin tokens: the one configured (KUMO_ADMIN_TOKEN) or generated on first start, stored as a
SHA-256 and compared in constant time, inside a session the `Store` opens."""

from __future__ import annotations

import hmac
import secrets

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.store.rows import new_id, now, sha256_hex
from gateway.store.tables import AdminTokenRow

ADMIN_TOKEN_PREFIX = "kumo_admin_"
ADMIN_TOKEN_LOCK_KEY = 0x6B756D6F01  # "kumo" + 1: the migrations hold "kumo"


async def ensure(s: AsyncSession, configured: str | None, *, is_postgresql: bool) -> str | None:
    """Make `configured` the only admin token, or, with none configured and none stored, generate
    one; returns a generated value (to print once), else None. On PostgreSQL replicas starting
    together take turns (an advisory lock held to the end of the transaction)."""
    if is_postgresql:
        await s.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADMIN_TOKEN_LOCK_KEY})
    rows = list(await s.scalars(select(AdminTokenRow)))
    if configured is not None:
        digest = sha256_hex(configured)
        if [r.secret_sha256 for r in rows] == [digest]:
            return None
        for r in rows:
            await s.delete(r)
        s.add(AdminTokenRow(id=new_id(), name="env", secret_sha256=digest, created_at=now()))
        return None
    if rows:
        return None
    value = f"{ADMIN_TOKEN_PREFIX}{secrets.token_urlsafe(32)}"
    s.add(AdminTokenRow(id=new_id(), name="generated", secret_sha256=sha256_hex(value), created_at=now()))
    return value


async def resolve(s: AsyncSession, value: str) -> str | None:
    """The admin identity (`admin:<name>`) a value belongs to, or None."""
    digest = sha256_hex(value)
    rows = list(await s.scalars(select(AdminTokenRow)))
    matches = [r for r in rows if hmac.compare_digest(digest, r.secret_sha256)]
    return f"admin:{matches[0].name}" if matches else None
