"""Conversions between table rows and `schemas.admin` Structs, and the helpers the store's
methods share (ids, clocks, hashing, audit rows, SQLite connection settings)."""

from __future__ import annotations

import datetime as dt
import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.errors import NotFound
from gateway.store.tables import AuditRow, TenantRow, TokenRow
from schemas.admin import Models, Quotas, Tenant, Token


def sha256_hex(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_id() -> str:
    return uuid.uuid4().hex


def normalise_url(url: str) -> str:
    """Accept plain `postgresql://` / `sqlite:///` URLs and pick the async driver for them."""
    for plain, driver in (
        ("postgresql://", "postgresql+asyncpg://"),
        ("postgres://", "postgresql+asyncpg://"),
        ("sqlite://", "sqlite+aiosqlite://"),
    ):
        if url.startswith(plain):
            return driver + url[len(plain) :]
    return url


@dataclass(frozen=True)
class Credential:
    """What a valid tenant token resolves to."""

    tenant: Tenant
    token_id: str
    expires_at: dt.datetime | None


def tenant_of(row: TenantRow) -> Tenant:
    quotas = Quotas(
        requests_per_minute=row.requests_per_minute,
        tokens_per_minute=row.tokens_per_minute,
        daily_neurons=row.daily_neurons,
    )
    return Tenant(
        id=row.id,
        name=row.name,
        plan=row.plan,  # type: ignore[arg-type]
        created_at=row.created_at,
        quotas=quotas,
        models=Models(allow=row.allowed_models),
        suspended_at=row.suspended_at,
    )


def token_of(row: TokenRow) -> Token:
    return Token(
        id=row.id,
        name=row.name,
        created_at=row.created_at,
        expires_at=row.expires_at,
        last_used_at=row.last_used_at,
        revoked_at=row.revoked_at,
    )


def apply_quotas(row: TenantRow, quotas: Quotas) -> None:
    row.requests_per_minute = quotas.requests_per_minute
    row.tokens_per_minute = quotas.tokens_per_minute
    row.daily_neurons = quotas.daily_neurons


async def live_tenant(
    s: AsyncSession, tenant_id: str, *, include_deleted: bool = False, lock: bool = False
) -> TenantRow:
    row = await s.get(TenantRow, tenant_id, with_for_update=lock) if len(tenant_id) == 32 else None
    if row is None or (row.deleted_at is not None and not include_deleted):
        raise NotFound(f"No tenant {tenant_id}")
    return row


def audit(
    s: AsyncSession,
    actor: str,
    request_id: str | None,
    action: str,
    tenant_id: str | None,
    object_id: str | None,
    detail: dict[str, Any],
) -> None:
    s.add(
        AuditRow(
            at=now(),
            actor=actor,
            request_id=request_id,
            action=action,
            tenant_id=tenant_id,
            object_id=object_id,
            detail=detail,
        )
    )


def plain(value: object) -> Any:
    """A JSON-ready copy of a Struct or datetime, for audit details."""
    return msgspec.to_builtins(value)


def sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")  # durable enough in WAL mode, and no fsync per commit
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
