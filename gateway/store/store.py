"""The tenant store: tenants, their tokens, quotas and model allow-lists, the usage ledger's rows
and the audit log, behind one async SQLAlchemy engine (SQLite by default, PostgreSQL at scale).

Every admin mutation writes its audit entry in the same transaction as the change, so the log
cannot miss one. Token values are never stored: a value is `kumo_<token id>_<secret>`; the id
finds the row, and the SHA-256 of the whole value is compared in constant time
(`hmac.compare_digest`, reliability §4.2). Methods return `schemas.admin` Structs, never ORM rows.
"""

from __future__ import annotations

import datetime as dt
import hmac
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import event, func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from gateway.errors import NotFound
from gateway.store import admin_tokens, counters, ledger
from gateway.store.migrate import upgrade_to_head
from gateway.store.rows import (
    Credential,
    apply_quotas,
    audit,
    live_tenant,
    new_id,
    normalise_url,
    now,
    plain,
    sha256_hex,
    sqlite_pragmas,
    tenant_of,
    token_of,
)
from gateway.store.tables import TenantRow, TokenRow
from schemas.admin import (
    AuditEntry,
    Plan,
    Quotas,
    QuotasPatch,
    Tenant,
    TenantCreate,
    TenantPatch,
    Token,
    TokenCreate,
    TokenCreated,
    UsageGroup,
    UsageRecord,
)

TOKEN_PREFIX = "kumo_"
DEV_TOKEN_NAME = "kumo serve"
_DUMMY_SHA256 = "0" * 64


def owner_only(database: Path) -> None:
    """The SQLite file readable by its owner alone: it holds tenants' batch prompts and answers, usage
    and the audit log (the umask left it 0644 in a 0755 data dir). Created so before SQLite opens it
    (SQLite gives its -wal and -shm files the database's mode); one made by an earlier version is
    narrowed, its -wal and -shm too."""
    if not database.exists():
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT, 0o600))  # empty: SQLite makes it a database
    for path in (
        database,
        database.with_name(database.name + "-wal"),
        database.with_name(database.name + "-shm"),
    ):
        if path.exists() and path.stat().st_mode & 0o077:
            path.chmod(0o600)


class Store:
    """Open with `await store.open(url)`; migrations run there. Safe to share across tasks."""

    def __init__(self) -> None:
        self._engine: AsyncEngine | None = None
        self._sessions: async_sessionmaker[AsyncSession] | None = None

    async def open(self, url: str) -> None:
        """Connect (creating a SQLite file's folder, e.g. the data dir) and migrate to the newest revision."""
        url = normalise_url(url)
        engine = create_async_engine(url, pool_pre_ping=not url.startswith("sqlite"))
        if engine.dialect.name == "sqlite":
            event.listen(engine.sync_engine, "connect", sqlite_pragmas)
            database = engine.url.database
            if database and database != ":memory:" and not database.startswith("file:"):
                Path(database).parent.mkdir(parents=True, exist_ok=True)
                owner_only(Path(database))
        await upgrade_to_head(engine)
        self._engine, self._sessions = engine, async_sessionmaker(engine, expire_on_commit=False)

    async def close(self) -> None:
        if self._engine is not None:
            await self._engine.dispose()
        self._engine = self._sessions = None

    @property
    def engine(self) -> AsyncEngine:
        assert self._engine is not None, "Store.open() first"
        return self._engine

    def _session(self) -> AsyncSession:
        assert self._sessions is not None, "Store.open() first"
        return self._sessions()

    # ---- tenants ------------------------------------------------------------------------------------
    async def create_tenant(self, body: TenantCreate, *, actor: str, request_id: str | None = None) -> Tenant:
        row = TenantRow(id=new_id(), name=body.name, plan=body.plan, created_at=now())
        apply_quotas(row, Quotas.for_plan(body.plan))
        async with self._session() as s, s.begin():
            s.add(row)
            audit(
                s, actor, request_id, "tenant.create", row.id, row.id, {"name": body.name, "plan": body.plan}
            )
        return tenant_of(row)

    async def list_tenants(self, *, page: int, per_page: int) -> tuple[list[Tenant], int]:
        live = TenantRow.deleted_at.is_(None)
        async with self._session() as s:
            total = await s.scalar(select(func.count()).select_from(TenantRow).where(live)) or 0
            rows = await s.scalars(
                select(TenantRow)
                .where(live)
                .order_by(TenantRow.created_at, TenantRow.id)
                .offset((page - 1) * per_page)
                .limit(per_page)
            )
            return [tenant_of(r) for r in rows], total

    async def get_tenant(self, tenant_id: str, *, include_deleted: bool = False) -> Tenant:
        async with self._session() as s:
            return tenant_of(await live_tenant(s, tenant_id, include_deleted=include_deleted))

    async def update_tenant(
        self, tenant_id: str, body: TenantPatch, *, actor: str, request_id: str | None = None
    ) -> Tenant:
        async with self._session() as s, s.begin():
            row = await live_tenant(s, tenant_id, lock=True)
            detail: dict[str, Any] = {}
            if body.name is not None and body.name != row.name:
                detail["name"], row.name = [row.name, body.name], body.name
            if body.plan is not None and body.plan != row.plan:
                detail["plan"], row.plan = [row.plan, body.plan], body.plan
                default = Quotas.for_plan(body.plan).daily_neurons
                detail["daily_neurons"], row.daily_neurons = [row.daily_neurons, default], default
            if body.suspended is not None and body.suspended != (row.suspended_at is not None):
                detail["suspended"] = [not body.suspended, body.suspended]
                row.suspended_at = now() if body.suspended else None
            audit(s, actor, request_id, "tenant.update", tenant_id, tenant_id, detail)
            return tenant_of(row)

    async def delete_tenant(self, tenant_id: str, *, actor: str, request_id: str | None = None) -> None:
        """Soft delete: the tenant disappears and its tokens are revoked; its usage stays."""
        at = now()
        async with self._session() as s, s.begin():
            row = await live_tenant(s, tenant_id, lock=True)
            row.deleted_at = at
            revoked = await s.scalars(
                update(TokenRow)
                .where(TokenRow.tenant_id == tenant_id, TokenRow.revoked_at.is_(None))
                .values(revoked_at=at)
                .returning(TokenRow.id)
            )
            audit(
                s,
                actor,
                request_id,
                "tenant.delete",
                tenant_id,
                tenant_id,
                {"revoked_token_ids": sorted(revoked.all())},
            )

    async def set_quotas(
        self, tenant_id: str, quotas: Quotas | QuotasPatch, *, actor: str, request_id: str | None = None
    ) -> Tenant:
        """All three quotas (`Quotas`), or those a `QuotasPatch` gives, the others kept (merged
        under the tenant's row lock: two patches of different keys both hold). Quotas that change
        nothing (an empty patch, the values already set) write nothing, the audit log included."""
        async with self._session() as s, s.begin():
            row = await live_tenant(s, tenant_id, lock=True)
            before = tenant_of(row).quotas
            quotas = quotas.applied_to(before) if isinstance(quotas, QuotasPatch) else quotas
            if quotas == before:
                return tenant_of(row)
            apply_quotas(row, quotas)
            audit(
                s,
                actor,
                request_id,
                "tenant.quotas",
                tenant_id,
                tenant_id,
                {"before": plain(before), "after": plain(quotas)},
            )
            return tenant_of(row)

    async def set_models(
        self, tenant_id: str, allow: list[str] | None, *, actor: str, request_id: str | None = None
    ) -> Tenant:
        async with self._session() as s, s.begin():
            row = await live_tenant(s, tenant_id, lock=True)
            before, row.allowed_models = row.allowed_models, None if allow is None else sorted(set(allow))
            audit(
                s,
                actor,
                request_id,
                "tenant.models",
                tenant_id,
                tenant_id,
                {"before": before, "after": row.allowed_models},
            )
            return tenant_of(row)

    # ---- tokens -------------------------------------------------------------------------------------
    async def create_token(
        self, tenant_id: str, body: TokenCreate, *, actor: str, request_id: str | None = None
    ) -> TokenCreated:
        token_id = new_id()
        value = f"{TOKEN_PREFIX}{token_id}_{secrets.token_urlsafe(32)}"
        row = TokenRow(
            id=token_id,
            tenant_id=tenant_id,
            name=body.name,
            secret_sha256=sha256_hex(value),
            created_at=now(),
            expires_at=body.expires_at,
        )
        async with self._session() as s, s.begin():
            await live_tenant(s, tenant_id)
            s.add(row)
            audit(
                s,
                actor,
                request_id,
                "token.create",
                tenant_id,
                token_id,
                {"name": body.name, "expires_at": plain(body.expires_at)},
            )
        return TokenCreated(
            id=token_id, name=row.name, value=value, created_at=row.created_at, expires_at=row.expires_at
        )

    async def list_tokens(self, tenant_id: str) -> list[Token]:
        async with self._session() as s:
            await live_tenant(s, tenant_id)
            rows = await s.scalars(
                select(TokenRow)
                .where(TokenRow.tenant_id == tenant_id)
                .order_by(TokenRow.created_at, TokenRow.id)
            )
            return [token_of(r) for r in rows]

    async def revoke_token(
        self, tenant_id: str, token_id: str, *, actor: str, request_id: str | None = None
    ) -> Token:
        async with self._session() as s, s.begin():
            await live_tenant(s, tenant_id)
            row = await s.get(TokenRow, token_id, with_for_update=True)
            if row is None or row.tenant_id != tenant_id or row.revoked_at is not None:
                raise NotFound(f"No token {token_id} for tenant {tenant_id}")
            row.revoked_at = now()
            audit(s, actor, request_id, "token.revoke", tenant_id, token_id, {"name": row.name})
            return token_of(row)

    async def resolve_token(self, value: str, *, is_use: bool = True) -> Credential | None:
        """The live tenant a token value belongs to, or None; records the token's last use unless
        `is_use` is false (a check that is not a request: `kumo serve` finding its saved dev token)."""
        token_id = value[len(TOKEN_PREFIX) : len(TOKEN_PREFIX) + 32] if value.startswith(TOKEN_PREFIX) else ""
        at = now()
        async with self._session() as s, s.begin():
            found = (
                (
                    await s.execute(
                        select(TokenRow, TenantRow)
                        .join(TenantRow, TokenRow.tenant_id == TenantRow.id)
                        .where(TokenRow.id == token_id)
                    )
                ).first()
                if len(token_id) == 32
                else None
            )
            expected = found[0].secret_sha256 if found else _DUMMY_SHA256
            if not hmac.compare_digest(sha256_hex(value), expected) or found is None:
                return None
            token, tenant = found
            if token.revoked_at is not None or tenant.deleted_at is not None:
                return None
            if token.expires_at is not None and token.expires_at <= at:
                return None
            if is_use:
                token.last_used_at = at
            return Credential(tenant=tenant_of(tenant), token_id=token.id, expires_at=token.expires_at)

    # ---- admin tokens (gateway.store.admin_tokens) ----------------------------------------------------
    async def ensure_admin_token(self, configured: str | None) -> str | None:
        """Make `configured` (KUMO_ADMIN_TOKEN) the only admin token, or, with none configured and
        none stored, generate one. Returns a generated value (to print once), else None. Replicas
        starting together on PostgreSQL take turns, so only one of them generates."""
        async with self._session() as s, s.begin():
            is_postgresql = self.engine.dialect.name == "postgresql"
            return await admin_tokens.ensure(s, configured, is_postgresql=is_postgresql)

    async def resolve_admin(self, value: str) -> str | None:
        """The admin identity (`admin:<name>`) a value belongs to, or None."""
        async with self._session() as s:
            return await admin_tokens.resolve(s, value)

    # ---- usage and audit (gateway.store.ledger) ----------------------------------------------------
    async def add_usage(self, records: Sequence[UsageRecord]) -> None:
        if not records:
            return
        async with self._session() as s, s.begin():
            ledger.add_usage(s, records)

    async def usage(
        self, tenant_id: str, *, since: dt.date, until: dt.date, group_by: Literal["day", "model"]
    ) -> list[UsageGroup]:
        """Usage per UTC day or per model, `since` and `until` inclusive; the tenant may be deleted."""
        async with self._session() as s:
            await live_tenant(s, tenant_id, include_deleted=True)
            return await ledger.usage_groups(s, tenant_id, since=since, until=until, group_by=group_by)

    async def neurons_on(self, tenant_id: str, day: dt.date) -> float:
        async with self._session() as s:
            return await ledger.neurons_on(s, tenant_id, day)

    # ---- quota counters without a Redis (gateway.store.counters) -----------------------------------
    async def reserve_counter(self, key: str, amount: float, limit: float) -> tuple[counters.Verdict, str]:
        async with self._session() as s, s.begin():
            return await counters.reserve(s, key, amount, limit)

    async def settle_counter(
        self, key: str, marker: str, amounts: Mapping[str, float], marker_ttl_s: int
    ) -> tuple[counters.Settled, str]:
        async with self._session() as s, s.begin():
            return await counters.settle(s, key, marker, amounts, marker_ttl_s)

    async def seed_counter(self, key: str, value: float, ttl_s: int, generation: str) -> str:
        async with self._session() as s, s.begin():
            return await counters.seed(
                s, key, value, ttl_s, generation, is_postgresql=self.engine.dialect.name == "postgresql"
            )

    async def sweep_counters(self) -> None:
        async with self._session() as s, s.begin():
            await counters.sweep(s)

    async def list_audit(
        self, *, page: int, per_page: int, tenant_id: str | None = None
    ) -> tuple[list[AuditEntry], int]:
        """Newest first."""
        async with self._session() as s:
            return await ledger.audit_page(s, page=page, per_page=per_page, tenant_id=tenant_id)

    # ---- `kumo serve` -------------------------------------------------------------------------------
    async def ensure_dev_tenant(
        self, keep: str | None = None, name: str = "development", plan: Plan = "paid"
    ) -> tuple[str, str]:
        """The development tenant (created once, same account id on every start) and its token:
        `keep` (the value the previous start wrote down) while it is still live, else a fresh one.
        Other live `kumo serve` tokens are revoked, since their values cannot be shown again; a
        revoked or expired `keep` is never brought back."""
        actor = "kumo serve"
        async with self._session() as s:
            existing = await s.scalar(
                select(TenantRow)
                .where(TenantRow.name == name, TenantRow.deleted_at.is_(None))
                .order_by(TenantRow.created_at)
                .limit(1)
            )
        tenant = (
            tenant_of(existing)
            if existing
            else await self.create_tenant(TenantCreate(name=name, plan=plan), actor=actor)
        )
        kept = await self.resolve_token(keep, is_use=False) if keep is not None else None
        tokens = await self.list_tokens(tenant.id)
        kept_id = next(
            (t.id for t in tokens if kept is not None and t.id == kept.token_id and t.name == DEV_TOKEN_NAME),
            None,
        )
        for token in tokens:
            if token.name == DEV_TOKEN_NAME and token.revoked_at is None and token.id != kept_id:
                await self.revoke_token(tenant.id, token.id, actor=actor)
        if keep is not None and kept_id is not None:
            return tenant.id, keep
        created = await self.create_token(tenant.id, TokenCreate(name=DEV_TOKEN_NAME), actor=actor)
        return tenant.id, created.value
