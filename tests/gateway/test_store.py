"""The tenant store on SQLite and PostgreSQL: migrations, tenants, tokens, usage, audit."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import hmac
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection, text, update
from sqlalchemy.ext.asyncio import create_async_engine
from tenancy_db import DIALECTS, create_database, drop_database, sqlite_store_fixture, store_fixture  # noqa: F401

from gateway.errors import NotFound
from gateway.store import Store
from gateway.store.migrate import alembic_config, upgrade_to_head
from gateway.store.tables import Table, TokenRow
from schemas.admin import Quotas, TenantCreate, TenantPatch, TokenCreate, UsageRecord

ADMIN = "admin:test"


def _diff(connection: Connection) -> list[object]:
    return compare_metadata(MigrationContext.configure(connection), Table.metadata)


async def test_migrations_build_exactly_the_tables_the_code_uses(store: Store) -> None:
    await upgrade_to_head(store.engine)  # a second run (a restart) is a no-op
    async with store.engine.connect() as connection:
        assert await connection.run_sync(_diff) == []
        version = (await connection.execute(text("SELECT version_num FROM alembic_version"))).scalar_one()
    assert version == "0008"


async def test_tenant_lifecycle(store: Store) -> None:
    free = await store.create_tenant(TenantCreate(name="acme", plan="free"), actor=ADMIN)
    assert len(free.id) == 32 and int(free.id, 16) >= 0
    assert free.quotas == Quotas(daily_neurons=10_000)  # Workers AI's free allocation
    paid = await store.create_tenant(TenantCreate(name="big", plan="paid"), actor=ADMIN)
    assert paid.quotas == Quotas()
    assert (await store.get_tenant(free.id)).created_at == free.created_at

    upgraded = await store.update_tenant(free.id, TenantPatch(plan="paid", name="acme inc"), actor=ADMIN)
    assert (upgraded.plan, upgraded.name, upgraded.quotas.daily_neurons) == ("paid", "acme inc", None)
    [entry], _ = await store.list_audit(page=1, per_page=1, tenant_id=free.id)
    assert entry.detail == {
        "name": ["acme", "acme inc"],
        "plan": ["free", "paid"],
        "daily_neurons": [10_000, None],
    }

    limited = await store.set_quotas(free.id, Quotas(requests_per_minute=5, daily_neurons=1.5), actor=ADMIN)
    assert limited.quotas == Quotas(requests_per_minute=5, tokens_per_minute=None, daily_neurons=1.5)
    models = await store.set_models(free.id, ["@cf/b", "@cf/a", "@cf/a"], actor=ADMIN)
    assert models.models.allow == ["@cf/a", "@cf/b"]
    assert (await store.set_models(free.id, None, actor=ADMIN)).models.allow is None

    await store.delete_tenant(free.id, actor=ADMIN)
    with pytest.raises(NotFound):
        await store.get_tenant(free.id)
    with pytest.raises(NotFound):
        await store.delete_tenant(free.id, actor=ADMIN)
    assert (await store.get_tenant(free.id, include_deleted=True)).id == free.id


async def test_listing_pages_through_live_tenants(store: Store) -> None:
    _, before = await store.list_tenants(page=1, per_page=1)
    made = [await store.create_tenant(TenantCreate(name=f"p{i}"), actor=ADMIN) for i in range(3)]
    await store.delete_tenant(made[1].id, actor=ADMIN)
    seen: list[str] = []
    page = 1
    while True:
        items, total = await store.list_tenants(page=page, per_page=2)
        if not items:
            break
        assert total == before + 2
        seen += [t.id for t in items]
        page += 1
    assert made[0].id in seen and made[2].id in seen and made[1].id not in seen
    assert len(seen) == len(set(seen)) == before + 2


async def test_token_value_is_never_stored_and_resolves_only_when_live(store: Store) -> None:
    tenant = await store.create_tenant(TenantCreate(name="tok", plan="paid"), actor=ADMIN)
    created = await store.create_token(tenant.id, TokenCreate(name="ci"), actor=ADMIN)
    async with store.engine.connect() as connection:
        rows = (await connection.execute(text("SELECT * FROM tokens"))).all()
        audit = (await connection.execute(text("SELECT detail FROM audit"))).all()
    dumped = repr(rows) + repr(audit)
    assert created.value not in dumped
    # token_urlsafe may itself hold "_": cut the known prefix, never split on the separator.
    secret = created.value.removeprefix(f"kumo_{created.id}_")
    assert len(secret) >= 40 and secret != created.value
    assert secret not in dumped
    assert hashlib.sha256(created.value.encode()).hexdigest() in dumped

    credential = await store.resolve_token(created.value)
    assert credential is not None and credential.tenant.id == tenant.id and credential.token_id == created.id
    [listed] = await store.list_tokens(tenant.id)
    assert listed.last_used_at is not None and listed.last_used_at >= created.created_at

    assert await store.resolve_token(created.value[:-1] + ("A" if created.value[-1] != "A" else "B")) is None
    assert await store.resolve_token("kumo_" + "0" * 32 + "_x") is None
    assert await store.resolve_token("") is None

    await store.revoke_token(tenant.id, created.id, actor=ADMIN)
    assert await store.resolve_token(created.value) is None
    with pytest.raises(NotFound):
        await store.revoke_token(tenant.id, created.id, actor=ADMIN)


async def test_tokens_compare_in_constant_time(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    tenant = await store.create_tenant(TenantCreate(name="ct"), actor=ADMIN)
    created = await store.create_token(tenant.id, TokenCreate(name="k"), actor=ADMIN)
    calls: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def spy(a: str, b: str) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert await store.resolve_token(created.value) is not None
    assert await store.resolve_token("kumo_" + "f" * 32 + "_guess") is None  # unknown id: still compared
    assert len(calls) == 2
    assert calls[0][0] == hashlib.sha256(created.value.encode()).hexdigest()


async def test_expired_token_does_not_resolve(store: Store) -> None:
    tenant = await store.create_tenant(TenantCreate(name="exp"), actor=ADMIN)
    soon = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    created = await store.create_token(tenant.id, TokenCreate(name="k", expires_at=soon), actor=ADMIN)
    assert await store.resolve_token(created.value) is not None
    async with store.engine.begin() as connection:
        past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        await connection.execute(update(TokenRow).where(TokenRow.id == created.id).values(expires_at=past))
    assert await store.resolve_token(created.value) is None


async def test_deleting_a_tenant_revokes_its_tokens_and_keeps_its_usage(store: Store) -> None:
    tenant = await store.create_tenant(TenantCreate(name="gone"), actor=ADMIN)
    created = await store.create_token(tenant.id, TokenCreate(name="k"), actor=ADMIN)
    await store.add_usage([UsageRecord(tenant_id=tenant.id, model="@cf/m", request_id="r1", prompt_tokens=7)])
    await store.delete_tenant(tenant.id, actor=ADMIN)
    assert await store.resolve_token(created.value) is None
    today = dt.datetime.now(dt.UTC).date()
    [row] = await store.usage(tenant.id, since=today, until=today, group_by="day")
    assert (row.requests, row.prompt_tokens) == (1, 7)


async def test_usage_groups_by_utc_day_and_by_model(store: Store) -> None:
    tenant = await store.create_tenant(TenantCreate(name="use"), actor=ADMIN)
    other = await store.create_tenant(TenantCreate(name="other"), actor=ADMIN)
    d1 = dt.datetime(2026, 3, 1, 23, 59, tzinfo=dt.UTC)
    d2 = dt.datetime(2026, 3, 2, 0, 30, tzinfo=dt.timezone(dt.timedelta(hours=2)))  # 1 March 22:30 UTC
    d3 = dt.datetime(2026, 3, 2, 0, 0, 1, tzinfo=dt.UTC)
    records = [
        UsageRecord(tenant_id=tenant.id, model="@cf/a", request_id="1", prompt_tokens=10, cached_tokens=4,
                    completion_tokens=5, neurons=1.25, at=d1),
        UsageRecord(tenant_id=tenant.id, model="@cf/b", request_id="2", prompt_tokens=1, completion_tokens=2,
                    neurons=0.5, at=d2),
        UsageRecord(tenant_id=tenant.id, model="@cf/a", request_id="3", prompt_tokens=100, neurons=2.0, at=d3),
        UsageRecord(tenant_id=other.id, model="@cf/a", request_id="4", prompt_tokens=999, neurons=9.0, at=d3),
    ]  # fmt: skip
    await store.add_usage(records)
    march = {"since": dt.date(2026, 3, 1), "until": dt.date(2026, 3, 31)}
    by_day = await store.usage(tenant.id, group_by="day", **march)
    assert [(r.day, r.requests, r.prompt_tokens, r.cached_tokens, r.completion_tokens) for r in by_day] == [
        ("2026-03-01", 2, 11, 4, 7),
        ("2026-03-02", 1, 100, 0, 0),
    ]
    assert by_day[0].neurons == pytest.approx(1.75)
    by_model = await store.usage(tenant.id, group_by="model", **march)
    assert [(r.model, r.requests, r.prompt_tokens, r.neurons) for r in by_model] == [
        ("@cf/a", 2, 110, pytest.approx(3.25)),
        ("@cf/b", 1, 1, pytest.approx(0.5)),
    ]
    only_first = await store.usage(
        tenant.id, group_by="day", since=dt.date(2026, 3, 1), until=dt.date(2026, 3, 1)
    )
    assert [r.day for r in only_first] == ["2026-03-01"]
    assert await store.neurons_on(tenant.id, dt.date(2026, 3, 2)) == pytest.approx(2.0)
    assert await store.neurons_on(tenant.id, dt.date(2026, 3, 3)) == 0.0


async def test_every_mutation_is_audited_newest_first(store: Store) -> None:
    tenant = await store.create_tenant(TenantCreate(name="aud"), actor="admin:alice")
    token = await store.create_token(tenant.id, TokenCreate(name="k"), actor="admin:bob")
    await store.set_quotas(tenant.id, Quotas(requests_per_minute=3), actor="admin:alice")
    await store.set_models(tenant.id, ["@cf/x"], actor="admin:alice")
    await store.update_tenant(tenant.id, TenantPatch(name="aud2"), actor="admin:alice")
    await store.revoke_token(tenant.id, token.id, actor="admin:bob")
    await store.delete_tenant(tenant.id, actor="admin:carol")
    entries, total = await store.list_audit(page=1, per_page=100, tenant_id=tenant.id)
    assert total == 7
    assert [(e.action, e.actor) for e in entries] == [
        ("tenant.delete", "admin:carol"),
        ("token.revoke", "admin:bob"),
        ("tenant.update", "admin:alice"),
        ("tenant.models", "admin:alice"),
        ("tenant.quotas", "admin:alice"),
        ("token.create", "admin:bob"),
        ("tenant.create", "admin:alice"),
    ]
    assert entries[4].detail["after"] == {
        "requests_per_minute": 3,
        "tokens_per_minute": None,
        "daily_neurons": None,
    }
    assert entries[2].detail == {"name": ["aud", "aud2"]}
    assert all(e.tenant_id == tenant.id and e.at.tzinfo is not None for e in entries)
    assert entries[5].object_id == token.id


async def test_admin_token_generated_once_or_taken_from_the_environment(sqlite_store: Store) -> None:
    store = sqlite_store
    generated = await store.ensure_admin_token(None)
    assert generated is not None and await store.resolve_admin(generated) == "admin:generated"
    assert await store.ensure_admin_token(None) is None  # not printed again on the next start
    assert await store.resolve_admin(generated) == "admin:generated"
    assert await store.ensure_admin_token("from-env-0123456789") is None
    assert await store.resolve_admin("from-env-0123456789") == "admin:env"
    assert await store.resolve_admin(generated) is None  # the configured token replaces it
    assert await store.resolve_admin("from-env-012345678") is None


async def test_dev_tenant_keeps_its_id_and_gets_a_fresh_token(sqlite_store: Store) -> None:
    store = sqlite_store
    first_id, first_token = await store.ensure_dev_tenant()
    second_id, second_token = await store.ensure_dev_tenant()
    assert first_id == second_id and first_token != second_token
    assert await store.resolve_token(first_token) is None
    credential = await store.resolve_token(second_token)
    assert credential is not None and credential.tenant.plan == "paid"


async def test_replicas_starting_together_migrate_once(tmp_path: Path) -> None:
    """Two gateways opening one fresh PostgreSQL database at once: the advisory lock serialises
    their migrations, so neither fails on a table the other just created."""
    url, name = await create_database("postgresql", tmp_path)
    stores = [Store(), Store(), Store()]
    try:
        await asyncio.gather(*(s.open(url) for s in stores))
        created = await stores[0].create_tenant(TenantCreate(name="shared"), actor=ADMIN)
        assert (await stores[2].get_tenant(created.id)).name == "shared"
        generated = await asyncio.gather(*(s.ensure_admin_token(None) for s in stores))
        [value] = [g for g in generated if g is not None]  # one admin token, printed by one replica
        assert {await s.resolve_admin(value) for s in stores} == {"admin:generated"}
    finally:
        for s in stores:
            await s.close()
        await drop_database(name)


@pytest.mark.parametrize("kind", DIALECTS)
async def test_a_database_from_revision_0001_upgrades_with_its_data(kind: str, tmp_path: Path) -> None:
    url, name = await create_database(kind, tmp_path)
    engine = create_async_engine(url)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(lambda c: command.upgrade(alembic_config(c), "0001"))
        old = Store()
        async with engine.begin() as connection:
            await connection.execute(
                text(
                    "INSERT INTO audit (at, actor, action, detail) VALUES (:at, 'admin:old', 'tenant.create', '{}')"
                ),
                {"at": dt.datetime(2026, 1, 1)},
            )
        await old.open(url)  # migrates to head
        [entry], _ = await old.list_audit(page=1, per_page=10)
        assert (entry.actor, entry.request_id) == ("admin:old", None)
        await old.close()
    finally:
        await engine.dispose()
        await drop_database(name)


async def test_the_default_sqlite_file_is_created_with_its_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "fresh" / ".kumo"
    store = Store()
    await store.open(f"sqlite:///{data_dir / 'kumo.db'}")  # plain URL: the async driver is picked
    try:
        tenant_id, token = await store.ensure_dev_tenant()
        assert (data_dir / "kumo.db").is_file()
        assert (await store.resolve_token(token)) is not None
    finally:
        await store.close()


async def test_the_sqlite_file_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    """It holds tenants' batch prompts and answers, usage and the audit log: 0600, its -wal too,
    and a file an earlier version left 0644 is narrowed when the store opens it."""
    path = tmp_path / "data" / "kumo.db"
    store = Store()
    await store.open(f"sqlite:///{path}")
    try:
        await store.create_tenant(TenantCreate(name="acme"), actor="test")
    finally:
        await store.close()
    wal = path.with_name("kumo.db-wal")
    assert path.stat().st_mode & 0o777 == 0o600
    assert not wal.exists() or wal.stat().st_mode & 0o777 == 0o600
    path.chmod(0o644)
    store = Store()
    await store.open(f"sqlite:///{path}")
    try:
        assert [t.name for t in (await store.list_tenants(page=1, per_page=10))[0]] == ["acme"]
    finally:
        await store.close()
    assert path.stat().st_mode & 0o777 == 0o600
