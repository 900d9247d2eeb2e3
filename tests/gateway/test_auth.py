"""Authenticator: bearer parsing, 401/403, the revocation window, expiry, admin identities."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt

import msgspec
import pytest
from sqlalchemy.exc import OperationalError
from tenancy_db import sqlite_store_fixture  # noqa: F401  (fixture)

from gateway.auth import Authenticator, TenantContext
from gateway.catalog import Catalog, load_catalog_file
from gateway.errors import Forbidden, Unauthenticated, Unavailable
from gateway.store import Credential, Store
from schemas.admin import TenantCreate, TokenCreate

ADMIN = "admin:test"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _tenant_token(store: Store, name: str = "t", **token: object) -> tuple[str, str, str]:
    tenant = await store.create_tenant(TenantCreate(name=name, plan="free"), actor=ADMIN)
    created = await store.create_token(tenant.id, TokenCreate(name="k", **token), actor=ADMIN)  # type: ignore[arg-type]
    return tenant.id, created.id, created.value


async def test_a_valid_token_resolves_to_its_tenant(sqlite_store: Store) -> None:
    tenant_id, token_id, value = await _tenant_token(sqlite_store, "ctx")
    await sqlite_store.set_models(tenant_id, ["@cf/a"], actor=ADMIN)
    auth = Authenticator(sqlite_store)
    ctx = await auth.authenticate(f"Bearer {value}", tenant_id)
    assert ctx == TenantContext(
        tenant_id=tenant_id,
        name="ctx",
        plan="free",
        allowed_models=frozenset({"@cf/a"}),
        token_id=token_id,
        quotas=ctx.quotas,
    )
    assert ctx.quotas.daily_neurons == 10_000
    kimi, glm = (m for m in Catalog.from_file(load_catalog_file(None)).models)
    assert kimi.aliases  # K2.5, served by K2.6
    a = msgspec.structs.replace(kimi, name="@cf/a", aliases=[])
    assert ctx.can_use(a) and not ctx.can_use(glm)
    # a list stored holding an alias (as written, before the admin API resolved them) still allows
    old = dataclasses.replace(ctx, allowed_models=frozenset(kimi.aliases))
    assert old.can_use(kimi) and not old.can_use(glm)
    assert (await auth.authenticate(f"bearer   {value} ", tenant_id)).tenant_id == tenant_id


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Basic abc",
        "Token kumo_x",
        "Bearer kumo_" + "0" * 32 + "_nope",
        "Bearer junk",
    ],
)
async def test_missing_or_bad_tokens_are_401_10000(sqlite_store: Store, header: str | None) -> None:
    tenant_id, _, _ = await _tenant_token(sqlite_store)
    with pytest.raises(Unauthenticated) as caught:
        await Authenticator(sqlite_store).authenticate(header, tenant_id)
    assert (caught.value.status, caught.value.code, caught.value.wire_message) == (
        401,
        10000,
        "Authentication error",
    )


async def test_another_accounts_path_is_403(sqlite_store: Store) -> None:
    _, _, value = await _tenant_token(sqlite_store, "mine")
    other_id, _, _ = await _tenant_token(sqlite_store, "theirs")
    with pytest.raises(Forbidden) as caught:
        await Authenticator(sqlite_store).authenticate(f"Bearer {value}", other_id)
    assert caught.value.status == 403


async def test_revocation_on_another_replica_takes_effect_within_the_cache_window(
    sqlite_store: Store,
) -> None:
    tenant_id, token_id, value = await _tenant_token(sqlite_store)
    clock = Clock()
    replica = Authenticator(sqlite_store, cache_seconds=2.0, clock=clock)
    await replica.authenticate(f"Bearer {value}", tenant_id)
    await sqlite_store.revoke_token(tenant_id, token_id, actor=ADMIN)  # done through another replica
    clock.now += 1.9
    await replica.authenticate(f"Bearer {value}", tenant_id)  # still cached: honoured at most 2 s
    clock.now += 0.1
    with pytest.raises(Unauthenticated):
        await replica.authenticate(f"Bearer {value}", tenant_id)


async def test_revocation_on_this_replica_is_immediate(sqlite_store: Store) -> None:
    tenant_id, token_id, value = await _tenant_token(sqlite_store)
    auth = Authenticator(sqlite_store, cache_seconds=3600)
    await auth.authenticate(f"Bearer {value}", tenant_id)
    await sqlite_store.revoke_token(tenant_id, token_id, actor=ADMIN)
    auth.forget(token_id=token_id)
    with pytest.raises(Unauthenticated):
        await auth.authenticate(f"Bearer {value}", tenant_id)


async def test_expiry_is_checked_even_while_cached(sqlite_store: Store) -> None:
    soon = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=0.4)
    tenant_id, _, value = await _tenant_token(sqlite_store, expires_at=soon)
    auth = Authenticator(sqlite_store, cache_seconds=3600)
    await auth.authenticate(f"Bearer {value}", tenant_id)
    await asyncio.sleep((soon - dt.datetime.now(dt.UTC)).total_seconds() + 0.05)
    with pytest.raises(Unauthenticated):
        await auth.authenticate(f"Bearer {value}", tenant_id)
    with pytest.raises(Unauthenticated):
        await Authenticator(sqlite_store).authenticate(f"Bearer {value}", tenant_id)


async def test_last_use_is_recorded_once_per_cache_window(sqlite_store: Store) -> None:
    tenant_id, _, value = await _tenant_token(sqlite_store)
    clock = Clock()
    auth = Authenticator(sqlite_store, cache_seconds=2.0, clock=clock)
    await auth.authenticate(f"Bearer {value}", tenant_id)
    [first] = await sqlite_store.list_tokens(tenant_id)
    await auth.authenticate(f"Bearer {value}", tenant_id)
    [cached] = await sqlite_store.list_tokens(tenant_id)
    assert first.last_used_at is not None and cached.last_used_at == first.last_used_at
    clock.now += 5
    await auth.authenticate(f"Bearer {value}", tenant_id)
    [later] = await sqlite_store.list_tokens(tenant_id)
    assert later.last_used_at is not None and later.last_used_at > first.last_used_at


async def test_admin_identity_and_scopes(sqlite_store: Store) -> None:
    admin_value = await sqlite_store.ensure_admin_token(None) or "unused"
    if await sqlite_store.resolve_admin(admin_value) is None:  # another test module configured one
        await sqlite_store.ensure_admin_token(admin_value := "admin-token-for-auth-tests")
    tenant_id, _, tenant_value = await _tenant_token(sqlite_store)
    auth = Authenticator(sqlite_store)
    assert (await auth.authenticate_admin(f"Bearer {admin_value}")).startswith("admin:")
    with pytest.raises(Forbidden):
        await auth.authenticate_admin(f"Bearer {tenant_value}")
    for header in (None, "Bearer nope", f"Bearer {admin_value}x"):
        with pytest.raises(Unauthenticated):
            await auth.authenticate_admin(header)
    with pytest.raises(Unauthenticated):  # the admin token is not a tenant token
        await auth.authenticate(f"Bearer {admin_value}", tenant_id)


class FailingStore(Store):
    """A real store whose database can be made to go away (as when PostgreSQL restarts)."""

    def __init__(self, real: Store) -> None:
        super().__init__()
        self.real = real
        self.is_down = False

    def _check(self) -> None:
        if self.is_down:
            raise OperationalError("SELECT", {}, ConnectionRefusedError("connection refused"))

    async def resolve_token(self, value: str) -> Credential | None:
        self._check()
        return await self.real.resolve_token(value)

    async def resolve_admin(self, value: str) -> str | None:
        self._check()
        return await self.real.resolve_admin(value)


async def test_an_unreachable_database_is_503_not_a_stale_grant(sqlite_store: Store) -> None:
    tenant_id, _, value = await _tenant_token(sqlite_store)
    clock = Clock()
    store = FailingStore(sqlite_store)
    auth = Authenticator(store, clock=clock)
    await auth.authenticate(f"Bearer {value}", tenant_id)
    store.is_down = True
    await auth.authenticate(f"Bearer {value}", tenant_id)  # within the window: the cached answer
    clock.now += 2.0
    with pytest.raises(Unavailable) as caught:
        await auth.authenticate(f"Bearer {value}", tenant_id)
    assert caught.value.status == 503
    with pytest.raises(Unavailable):
        await auth.authenticate_admin("Bearer whatever")
    store.is_down = False
    assert (await auth.authenticate(f"Bearer {value}", tenant_id)).tenant_id == tenant_id


class GatedStore:
    """The store, whose token reads answer only at `release` once `is_gated` (a slow database)."""

    def __init__(self, store: Store) -> None:
        self.store, self.is_gated, self.release, self.num_reads = store, False, asyncio.Event(), 0

    async def resolve_token(self, value: str) -> Credential | None:
        self.num_reads += 1
        credential = await self.store.resolve_token(value)
        if self.is_gated:
            await self.release.wait()
        return credential


async def test_a_token_in_use_is_refreshed_in_the_background_never_past_its_window(
    sqlite_store: Store,
) -> None:
    tenant_id, token_id, value = await _tenant_token(sqlite_store)
    store, clock = GatedStore(sqlite_store), Clock()
    auth = Authenticator(store, cache_seconds=2.0, clock=clock)  # type: ignore[arg-type]
    await auth.authenticate(f"Bearer {value}", tenant_id)
    store.is_gated = True  # from now on the store is slow
    clock.now += 1.2  # past half the window: served at once, refreshed behind
    await asyncio.wait_for(auth.authenticate(f"Bearer {value}", tenant_id), 1)
    await asyncio.sleep(0.01)
    assert store.num_reads == 2
    store.release.set()
    await asyncio.sleep(0.05)
    clock.now += 0.85  # 2.05 s after the first read, 0.85 s after the refresh: no wait, no read
    store.release.clear()
    await asyncio.wait_for(auth.authenticate(f"Bearer {value}", tenant_id), 1)
    assert store.num_reads == 2

    # a revocation on this replica while a refresh is reading is not undone by that read
    clock.now += 0.5  # 1.35 s after the refresh
    await auth.authenticate(f"Bearer {value}", tenant_id)  # starts a refresh, which waits
    await asyncio.sleep(0.01)
    await sqlite_store.revoke_token(tenant_id, token_id, actor=ADMIN)
    auth.forget(token_id=token_id)
    store.release.set()
    await asyncio.sleep(0.05)
    with pytest.raises(Unauthenticated):
        await auth.authenticate(f"Bearer {value}", tenant_id)
