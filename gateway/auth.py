"""Bearer-token authentication for the public routes and the admin API (DESIGN.md §2 step 1).

A tenant token resolves, through the store, to a `TenantContext`; the result is cached in this
replica for `cache_seconds`, so a revoked token stops working everywhere within that window
(and at once on the replica that revoked it, through `forget`). The cache keys on the token's
SHA-256, never on the value. A suspension is read with the token, so it takes effect within the
same window (at once on the replica that suspended). An entry past half its window is still
served while a background read refreshes it, so a token in steady use never waits on the store
(its round trip, a write of `last_used_at`, was the gateway's slowest step); none is served past
the window. Admin tokens are checked against the store on every call: admin traffic is rare and
its revocation must be immediate.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import structlog
from sqlalchemy.exc import SQLAlchemyError

from gateway.errors import Forbidden, OtherAccount, Suspended, Unauthenticated, Unavailable
from gateway.store import Credential, Store, sha256_hex
from schemas.admin import Quotas
from schemas.catalog import ModelSpec

log = structlog.get_logger("kumo.auth")
AUTH_ERROR = "Authentication error"  # Workers AI's message for 10000 (reference §6)


@dataclass(frozen=True)
class TenantContext:
    """Who is calling: the tenant (a Workers AI account) behind a valid token."""

    tenant_id: str
    name: str
    plan: Literal["free", "paid"]
    allowed_models: frozenset[str] | None  # None: every model in the catalog
    token_id: str
    quotas: Quotas = field(default_factory=Quotas)

    def can_use(self, model: ModelSpec) -> bool:
        """The allow-list names the model by its id or an alias (lists stored before aliases were
        resolved on the way in hold them as written)."""
        allowed = self.allowed_models
        return allowed is None or model.name in allowed or any(a in allowed for a in model.aliases)

    @classmethod
    def from_credential(cls, credential: Credential) -> TenantContext:
        t = credential.tenant
        allowed = None if t.models.allow is None else frozenset(t.models.allow)
        return cls(
            tenant_id=t.id,
            name=t.name,
            plan=t.plan,
            allowed_models=allowed,
            token_id=credential.token_id,
            quotas=t.quotas,
        )


def bearer(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` header, or 401."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthenticated(AUTH_ERROR)
    return token


@dataclass
class _Entry:
    fetched_at: float
    credential: Credential


class Authenticator:
    """Resolves bearer tokens to tenants (cached briefly) and to admin identities."""

    def __init__(
        self,
        store: Store,
        *,
        cache_seconds: float = 2.0,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._cache_seconds = cache_seconds
        self._max_entries = max_entries
        self._clock = clock
        self._cache: dict[str, _Entry] = {}
        self._refreshing: dict[str, asyncio.Task[None]] = {}  # key → its background refresh
        self._generation = 0  # bumped by `forget`: a refresh begun before it must not store its read

    async def credential(self, authorization: str | None) -> Credential:
        """The caller's token, whatever account it is for (`/memberships` asks which); 401 for a
        missing, unknown, revoked or expired token, 503 while the store cannot be reached."""
        credential = await self._credential(bearer(authorization))
        if credential is None:
            raise Unauthenticated(AUTH_ERROR)
        return credential

    async def authenticate(self, authorization: str | None, account_id: str) -> TenantContext:
        """The caller's tenant; 401 for a missing, unknown, revoked or expired token, 403 when the
        path's `account_id` is another tenant's or the tenant is suspended."""
        credential = await self.credential(authorization)
        if credential.tenant.id != account_id:
            raise OtherAccount(AUTH_ERROR)
        if credential.tenant.suspended_at is not None:
            raise Suspended("This account is suspended; ask its administrator to resume it")
        return TenantContext.from_credential(credential)

    async def authenticate_admin(self, authorization: str | None) -> str:
        """The admin identity for the audit log; 401 for no or a bad token, 403 for a tenant token."""
        value = bearer(authorization)
        try:
            actor = await self._store.resolve_admin(value)
        except (SQLAlchemyError, OSError) as exc:
            raise Unavailable("Authentication is temporarily unavailable, please try again.") from exc
        if actor is not None:
            return actor
        if await self._credential(value) is not None:
            raise Forbidden("This route needs the admin token")
        raise Unauthenticated(AUTH_ERROR)

    def forget(self, *, token_id: str | None = None, tenant_id: str | None = None) -> None:
        """Drop cached entries of a token or a tenant (called after a revocation on this replica)."""
        self._generation += 1
        for key, entry in list(self._cache.items()):
            if entry.credential.token_id == token_id or entry.credential.tenant.id == tenant_id:
                del self._cache[key]

    async def _credential(self, value: str) -> Credential | None:
        key = sha256_hex(value)
        now = self._clock()
        entry = self._cache.get(key)
        if entry is None or now - entry.fetched_at >= self._cache_seconds:
            try:
                entry = await self._fetch(key, value, now, self._generation)
            except (SQLAlchemyError, OSError) as exc:  # never fall back to a stale entry: it may be revoked
                raise Unavailable("Authentication is temporarily unavailable, please try again.") from exc
            if entry is None:
                return None
        elif now - entry.fetched_at >= self._cache_seconds / 2 and key not in self._refreshing:
            self._refreshing[key] = asyncio.create_task(self._refresh(key, value, now, self._generation))
        expires_at = entry.credential.expires_at
        if expires_at is not None and expires_at <= dt.datetime.now(dt.UTC):
            return None
        return entry.credential

    async def _fetch(self, key: str, value: str, now: float, generation: int) -> _Entry | None:
        """Read the token from the store and cache what it says, unless `forget` ran meanwhile."""
        credential = await self._store.resolve_token(value)
        if generation != self._generation:  # revoked on this replica while we read: read again
            return await self._fetch(key, value, now, self._generation)
        self._cache.pop(key, None)
        if credential is None:
            return None
        entry = self._cache[key] = _Entry(fetched_at=now, credential=credential)
        while len(self._cache) > self._max_entries:
            del self._cache[next(iter(self._cache))]
        return entry

    async def _refresh(self, key: str, value: str, now: float, generation: int) -> None:
        try:
            await self._fetch(key, value, now, generation)
        except (SQLAlchemyError, OSError) as exc:  # the entry runs out at its window; a request then retries
            log.warning("token_refresh_failed", error=repr(exc))
        finally:
            del self._refreshing[key]
