"""The admin API over HTTP, on SQLite and PostgreSQL: every route, its envelope, 404s and 400s,
the audit log, and the authorisation matrix (no token, bad token, revoked token, tenant token, admin)."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Mount
from tenancy_db import store_fixture  # noqa: F401  (fixture)

from gateway.admin import MAX_BODY_BYTES, admin_routes
from gateway.app import render_error, render_http_error
from gateway.auth import Authenticator
from gateway.catalog import Catalog, load_catalog_file
from gateway.errors import KumoError, OtherAccount, Suspended, Unauthenticated
from gateway.store import Store
from gateway.usage import UsageLedger
from schemas.admin import UsageRecord

ADMIN_TOKEN = f"admin-{uuid.uuid4().hex}"
AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass
class AdminOnlyServices:
    store: Store
    authenticator: Authenticator
    catalog: Catalog = field(default_factory=lambda: Catalog.from_file(load_catalog_file(None)))


@dataclass
class Admin:
    http: httpx.AsyncClient
    services: AdminOnlyServices

    async def call(self, method: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        headers = kw.pop("headers", AUTH)
        return await self.http.request(method, f"/admin/v1{path}", json=body, headers=headers, **kw)

    async def ok(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        r = await self.call(method, path, body, **kw)
        assert r.status_code == 200, r.text
        envelope = r.json()
        assert envelope["success"] is True and envelope["errors"] == [] and envelope["messages"] == []
        return envelope["result"]

    async def tenant(self, name: str = "acme", plan: str = "free") -> dict[str, Any]:
        result: dict[str, Any] = await self.ok("POST", "/tenants", {"name": name, "plan": plan})
        return result


@pytest.fixture(name="admin", scope="module")
async def admin_fixture(store: Store) -> AsyncIterator[Admin]:
    await store.ensure_admin_token(ADMIN_TOKEN)
    services = AdminOnlyServices(store=store, authenticator=Authenticator(store))
    app = Starlette(
        routes=[Mount("/admin/v1", routes=admin_routes(services))],
        exception_handlers={KumoError: render_error, HTTPException: render_http_error},
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kumo") as http:
        yield Admin(http, services)


def error_of(r: httpx.Response) -> tuple[int, int, str]:
    envelope = r.json()
    assert envelope["result"] is None and envelope["success"] is False and envelope["messages"] == []
    [error] = envelope["errors"]
    assert not error["message"].startswith("AiError")
    return r.status_code, error["code"], error["message"]


async def test_create_and_read_a_tenant(admin: Admin) -> None:
    created = await admin.tenant("acme", "free")
    assert set(created) == {"id", "name", "plan", "created_at", "quotas", "models", "suspended_at"}
    assert len(created["id"]) == 32 and created["created_at"].endswith("Z")
    assert created["quotas"] == {
        "requests_per_minute": None,
        "tokens_per_minute": None,
        "daily_neurons": 10000.0,
    }
    assert created["models"] == {"allow": None}
    assert await admin.ok("GET", f"/tenants/{created['id']}") == created
    paid = await admin.tenant("big", "paid")
    assert paid["quotas"]["daily_neurons"] is None


@pytest.mark.parametrize(
    "body",
    [
        {"name": "x", "plan": "gold"},
        {"name": "", "plan": "free"},
        {"name": "a\u0000b", "plan": "free"},  # PostgreSQL cannot store a NUL: a 400, not a 500
        {"name": "line\nbreak", "plan": "free"},
        {"name": "x", "id": "0" * 32},  # mass assignment
        {"plan": "free"},
        [],
        "not json",
        None,
    ],
)
async def test_invalid_tenant_bodies_are_400(admin: Admin, body: Any) -> None:
    if body == "not json":
        r = await admin.http.post("/admin/v1/tenants", content=b"{nope", headers=AUTH)
    else:
        r = await admin.call("POST", "/tenants", body)
    status, code, message = error_of(r)
    assert (status, code) == (400, 6007)
    if isinstance(body, dict) and "id" in body:
        assert "id" in message


async def test_listing_pages_and_ends_with_an_empty_page(admin: Admin) -> None:
    for i in range(3):
        await admin.tenant(f"page{i}")
    r = await admin.call("GET", "/tenants", params={"page": 1, "per_page": 2})
    envelope = r.json()
    info = envelope["result_info"]
    assert (info["page"], info["per_page"], info["count"]) == (1, 2, 2) and info["total_count"] >= 3
    ids: list[str] = []
    page = 1
    while items := await admin.ok("GET", "/tenants", params={"page": page, "per_page": 2}):
        ids += [t["id"] for t in items]
        page += 1
    assert len(ids) == len(set(ids)) == info["total_count"]
    # '²' passes `str.isdigit` and 4,400 digits are more than `int` takes: a 400 each, not a 500
    for bad in ({"page": 0}, {"per_page": 1001}, {"page": "x"}, {"page": "\u00b2"}, {"per_page": "1" * 4400}):
        assert error_of(await admin.call("GET", "/tenants", params=bad))[:2] == (400, 6007)


async def test_patch_and_delete(admin: Admin) -> None:
    tenant = await admin.tenant("before", "free")
    path = f"/tenants/{tenant['id']}"
    patched = await admin.ok("PATCH", path, {"name": "after", "plan": "paid"})
    assert (patched["name"], patched["plan"], patched["quotas"]["daily_neurons"]) == ("after", "paid", None)
    assert error_of(await admin.call("PATCH", path, {"created_at": "2020-01-01T00:00:00Z"}))[:2] == (
        400,
        6007,
    )
    assert await admin.ok("DELETE", path) == {"id": tenant["id"]}
    for method in ("GET", "PATCH", "DELETE"):
        assert (
            error_of(await admin.call(method, path, {"name": "x"} if method == "PATCH" else None))[0] == 404
        )


@pytest.mark.parametrize("tenant_id", [uuid.uuid4().hex, "not-an-id", "A" * 32])
async def test_unknown_ids_are_404(admin: Admin, tenant_id: str) -> None:
    known = await admin.tenant()
    quotas = {"requests_per_minute": 1, "tokens_per_minute": None, "daily_neurons": None}
    for method, path, body in [
        ("GET", f"/tenants/{tenant_id}", None),
        ("PATCH", f"/tenants/{tenant_id}", {"name": "x"}),
        ("DELETE", f"/tenants/{tenant_id}", None),
        ("POST", f"/tenants/{tenant_id}/tokens", {"name": "k"}),
        ("GET", f"/tenants/{tenant_id}/tokens", None),
        ("DELETE", f"/tenants/{tenant_id}/tokens/{uuid.uuid4().hex}", None),
        ("DELETE", f"/tenants/{known['id']}/tokens/{tenant_id}", None),
        ("PUT", f"/tenants/{tenant_id}/quotas", quotas),
        ("PUT", f"/tenants/{tenant_id}/models", {"allow": None}),
        ("GET", f"/tenants/{tenant_id}/usage", None),
    ]:
        r = await admin.call(method, path, body)
        assert error_of(r)[:2] == (404, 7000), (method, path)


async def test_tokens_are_shown_once_and_revoked_at_once(admin: Admin) -> None:
    tenant = await admin.tenant("tok", "paid")
    path = f"/tenants/{tenant['id']}/tokens"
    expires = (dt.datetime.now(dt.UTC) + dt.timedelta(days=30)).strftime("%Y-%m-%dT%H:%M:%SZ")
    created = await admin.ok("POST", path, {"name": "ci", "expires_at": expires})
    assert set(created) == {"id", "name", "value", "created_at", "expires_at"}
    assert created["expires_at"] == expires
    listed = await admin.ok("GET", path)
    assert [t["id"] for t in listed] == [created["id"]] and created["value"] not in str(listed)
    assert set(listed[0]) == {"id", "name", "created_at", "expires_at", "last_used_at", "revoked_at"}

    auth = admin.services.authenticator
    ctx = await auth.authenticate(f"Bearer {created['value']}", tenant["id"])
    assert ctx.token_id == created["id"]
    [used] = await admin.ok("GET", path)
    assert used["last_used_at"] is not None

    revoked = await admin.ok("DELETE", f"{path}/{created['id']}")
    assert revoked["revoked_at"] is not None
    with pytest.raises(Unauthenticated):  # this replica drops its cached copy at once
        await auth.authenticate(f"Bearer {created['value']}", tenant["id"])
    assert error_of(await admin.call("DELETE", f"{path}/{created['id']}"))[0] == 404

    past = (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)).isoformat()
    for body in ({"name": "k", "expires_at": past}, {"name": "k", "expires_at": "2099-01-01T00:00:00"}, {},
                 {"name": "nul\u0000"}):  # fmt: skip
        assert error_of(await admin.call("POST", path, body))[:2] == (400, 6007)


async def test_a_suspended_tenants_tokens_are_refused_until_it_is_resumed(admin: Admin) -> None:
    """Suspending refuses every token of the tenant with a 403 that says why (at once on this
    replica), leaves other tenants alone, keeps the tokens, and is audited; resuming undoes it."""
    tenant, bystander = await admin.tenant("paused", "paid"), await admin.tenant("bystander", "paid")
    path = f"/tenants/{tenant['id']}"
    created = await admin.ok("POST", f"{path}/tokens", {"name": "k"})
    theirs = await admin.ok("POST", f"/tenants/{bystander['id']}/tokens", {"name": "k"})
    auth = admin.services.authenticator
    await auth.authenticate(f"Bearer {created['value']}", tenant["id"])  # cached
    assert tenant["suspended_at"] is None

    suspended = await admin.ok("PATCH", path, {"suspended": True})
    assert suspended["suspended_at"] is not None and (await admin.ok("GET", path)) == suspended
    with pytest.raises(Suspended) as refused:
        await auth.authenticate(f"Bearer {created['value']}", tenant["id"])
    assert (refused.value.status, refused.value.code) == (403, 9109)
    assert "suspended" in refused.value.message
    with pytest.raises(OtherAccount):  # another account's path is still "Authentication error"
        await auth.authenticate(f"Bearer {created['value']}", bystander["id"])
    await auth.authenticate(f"Bearer {theirs['value']}", bystander["id"])
    assert (await admin.ok("PATCH", path, {"suspended": True}))["suspended_at"] == suspended["suspended_at"]
    assert [t["revoked_at"] for t in await admin.ok("GET", f"{path}/tokens")] == [None]

    assert (await admin.ok("PATCH", path, {"suspended": False}))["suspended_at"] is None
    ctx = await auth.authenticate(f"Bearer {created['value']}", tenant["id"])
    assert ctx.token_id == created["id"]
    assert error_of(await admin.call("PATCH", path, {"suspended": "yes"}))[:2] == (400, 6007)
    details = [
        e["detail"]
        for e in await admin.ok("GET", "/audit", params={"tenant_id": tenant["id"]})
        if e["action"] == "tenant.update"
    ]
    assert details == [{"suspended": [True, False]}, {}, {"suspended": [False, True]}]


async def test_deleting_a_tenant_revokes_its_tokens(admin: Admin) -> None:
    tenant = await admin.tenant("doomed")
    created = await admin.ok("POST", f"/tenants/{tenant['id']}/tokens", {"name": "k"})
    auth = admin.services.authenticator
    await auth.authenticate(f"Bearer {created['value']}", tenant["id"])
    await admin.ok("DELETE", f"/tenants/{tenant['id']}")
    with pytest.raises(Unauthenticated):
        await auth.authenticate(f"Bearer {created['value']}", tenant["id"])
    assert await admin.services.store.resolve_token(created["value"]) is None


async def test_quotas_and_models(admin: Admin) -> None:
    tenant = await admin.tenant("limits", "free")
    tid = tenant["id"]
    quotas = {"requests_per_minute": 60, "tokens_per_minute": 10_000, "daily_neurons": None}
    assert await admin.ok("PUT", f"/tenants/{tid}/quotas", quotas) == quotas
    whole = {**quotas, "requests_per_minute": 60.0, "tokens_per_minute": 1e4}  # JavaScript's numbers
    assert await admin.ok("PUT", f"/tenants/{tid}/quotas", whole) == quotas
    assert (await admin.ok("GET", f"/tenants/{tid}"))["quotas"] == quotas
    for bad in ({"requests_per_minute": 60}, {**quotas, "requests_per_minute": -1}, {**quotas, "burst": 3},
                {**quotas, "requests_per_minute": 60.5}):  # fmt: skip
        assert error_of(await admin.call("PUT", f"/tenants/{tid}/quotas", bad))[:2] == (400, 6007)
    # PATCH changes the keys it gives (null: unlimited) and keeps the others
    patched = await admin.ok("PATCH", f"/tenants/{tid}/quotas", {"daily_neurons": 500})
    assert patched == {**quotas, "daily_neurons": 500}
    patched = await admin.ok("PATCH", f"/tenants/{tid}/quotas", {"tokens_per_minute": None})
    assert patched == {**quotas, "daily_neurons": 500, "tokens_per_minute": None}
    assert await admin.ok("PATCH", f"/tenants/{tid}/quotas", {}) == patched
    assert await admin.ok("PATCH", f"/tenants/{tid}/quotas", {"daily_neurons": 500}) == patched
    audit = await admin.ok("GET", "/audit", params={"tenant_id": tid, "per_page": 100})
    changes = [e["detail"]["after"] for e in audit if e["action"] == "tenant.quotas"]
    assert changes == [patched, {**quotas, "daily_neurons": 500}, quotas]  # newest first: no-ops left out
    for bad in ({"requests_per_minute": -1}, {"burst": 3}):
        assert error_of(await admin.call("PATCH", f"/tenants/{tid}/quotas", bad))[:2] == (400, 6007)
    assert await admin.ok("PUT", f"/tenants/{tid}/quotas", quotas) == quotas

    token = await admin.ok("POST", f"/tenants/{tid}/tokens", {"name": "k"})
    auth = admin.services.authenticator
    ctx = await auth.authenticate(f"Bearer {token['value']}", tid)
    assert ctx.allowed_models is None and ctx.quotas.requests_per_minute == 60
    assert await admin.ok("PUT", f"/tenants/{tid}/models", {"allow": ["@cf/zai-org/glm-5.2"]}) == {
        "allow": ["@cf/zai-org/glm-5.2"]
    }
    ctx = await auth.authenticate(f"Bearer {token['value']}", tid)
    assert ctx.allowed_models == frozenset({"@cf/zai-org/glm-5.2"})
    assert await admin.ok("PUT", f"/tenants/{tid}/models", {"allow": None}) == {"allow": None}
    assert error_of(await admin.call("PUT", f"/tenants/{tid}/models", {"allow": "x"}))[:2] == (400, 6007)
    # a name the catalog lacks (a typo would deny the model it meant to allow) is refused; an alias
    # is kept as the model's id, which requests are authorised under
    typo = error_of(
        await admin.call("PUT", f"/tenants/{tid}/models", {"allow": ["@cf/zai-org/glm-5.2", "@cf/zai/glm"]})
    )
    assert typo == (400, 6007, "allow[1]: no model '@cf/zai/glm' in the catalog"), typo
    assert (await admin.ok("GET", f"/tenants/{tid}"))["models"] == {"allow": None}  # unchanged
    alias = {"allow": ["@cf/moonshotai/kimi-k2.5"]}
    assert await admin.ok("PUT", f"/tenants/{tid}/models", alias) == {"allow": ["@cf/moonshotai/kimi-k2.6"]}


async def test_usage_by_day_and_model_through_the_ledger(admin: Admin) -> None:
    tenant = await admin.tenant("metered", "paid")
    tid = tenant["id"]
    ledger = UsageLedger(admin.services.store, flush_seconds=60)
    day1 = dt.datetime(2026, 6, 1, 10, tzinfo=dt.UTC)
    day2 = dt.datetime(2026, 6, 2, 10, tzinfo=dt.UTC)
    for i, (model, at, p, c, o, n) in enumerate(
        [("@cf/a", day1, 100, 20, 10, 1.0), ("@cf/b", day1, 5, 0, 5, 0.25), ("@cf/a", day2, 50, 0, 50, 2.0)]
    ):
        ledger.record(
            UsageRecord(
                tenant_id=tid, model=model, request_id=f"r{i}", prompt_tokens=p, cached_tokens=c,
                completion_tokens=o, neurons=n, at=at, status=499 if i == 1 else 200,
            )
        )  # fmt: skip
    await ledger.stop()
    june = {"since": "2026-06-01", "until": "2026-06-30"}
    by_day = await admin.ok("GET", f"/tenants/{tid}/usage", params={**june, "group_by": "day"})
    assert by_day == [
        {"day": "2026-06-01", "model": None, "requests": 2, "failed_requests": 1, "prompt_tokens": 105,
         "cached_tokens": 20, "completion_tokens": 15, "neurons": 1.25},
        {"day": "2026-06-02", "model": None, "requests": 1, "failed_requests": 0, "prompt_tokens": 50,
         "cached_tokens": 0, "completion_tokens": 50, "neurons": 2.0},
    ]  # fmt: skip
    by_model = await admin.ok("GET", f"/tenants/{tid}/usage", params={**june, "group_by": "model"})
    assert [(r["model"], r["requests"], r["failed_requests"], r["neurons"]) for r in by_model] == [
        ("@cf/a", 2, 0, 3.0),
        ("@cf/b", 1, 1, 0.25),
    ]
    one_day = await admin.ok(
        "GET", f"/tenants/{tid}/usage", params={"since": "2026-06-02", "until": "2026-06-02"}
    )
    assert [r["day"] for r in one_day] == ["2026-06-02"]
    assert await admin.ok("GET", f"/tenants/{tid}/usage") == []  # default: the last 30 days

    await admin.ok("DELETE", f"/tenants/{tid}")  # usage history outlives the tenant
    assert await admin.ok("GET", f"/tenants/{tid}/usage", params={**june, "group_by": "day"}) == by_day
    for bad in ({"since": "2026-6-1"}, {"since": "2026-06-31"}, {"group_by": "week"},
                {"since": "2026-06-02", "until": "2026-06-01"}):  # fmt: skip
        assert error_of(await admin.call("GET", f"/tenants/{tid}/usage", params=bad))[:2] == (400, 6007)
    # the first days of the calendar: no default 29 days before them to compute, nor to fail on
    for early in ({"since": "0001-01-01", "until": "0001-01-05"}, {"until": "0001-01-01"}):
        assert await admin.ok("GET", f"/tenants/{tid}/usage", params=early) == []


async def test_audit_lists_every_mutation_with_who_and_when(admin: Admin) -> None:
    tenant = await admin.tenant("audited")
    tid = tenant["id"]
    token = await admin.ok("POST", f"/tenants/{tid}/tokens", {"name": "k"})
    await admin.ok("PUT", f"/tenants/{tid}/quotas", {"requests_per_minute": 1, "tokens_per_minute": None,
                                                      "daily_neurons": 5})  # fmt: skip
    await admin.ok("PUT", f"/tenants/{tid}/models", {"allow": ["@cf/zai-org/glm-5.2"]})
    await admin.ok("PATCH", f"/tenants/{tid}", {"name": "audited2"})
    await admin.ok("DELETE", f"/tenants/{tid}/tokens/{token['id']}")
    await admin.ok("DELETE", f"/tenants/{tid}")
    r = await admin.call("GET", "/audit", params={"tenant_id": tid, "per_page": 100})
    entries = r.json()["result"]
    assert r.json()["result_info"]["total_count"] == 7
    assert [e["action"] for e in entries] == [
        "tenant.delete", "token.revoke", "tenant.update", "tenant.models", "tenant.quotas", "token.create",
        "tenant.create",
    ]  # fmt: skip
    assert {e["actor"] for e in entries} == {"admin:env"}
    assert all(len(e["request_id"]) == 32 for e in entries) and len({e["request_id"] for e in entries}) == 7
    assert all(e["at"].endswith("Z") for e in entries)
    assert token["value"] not in r.text
    latest = await admin.ok("GET", "/audit", params={"per_page": 1})
    assert latest[0]["action"] == "tenant.delete" and latest[0]["tenant_id"] == tid
    for bad in ("a\u0000b", "not-a-tenant-id"):  # a NUL reached PostgreSQL and was a 500
        assert error_of(await admin.call("GET", "/audit", params={"tenant_id": bad}))[:2] == (400, 6007)


async def test_authorisation_matrix(admin: Admin) -> None:
    """Every admin route × {no token, bad token, revoked token, own tenant's token, another
    tenant's token} is refused and changes nothing; the admin token succeeds."""
    tenant = await admin.tenant("matrix")
    tid = tenant["id"]
    live = await admin.ok("POST", f"/tenants/{tid}/tokens", {"name": "live"})
    revoked = await admin.ok("POST", f"/tenants/{tid}/tokens", {"name": "revoked"})
    await admin.ok("DELETE", f"/tenants/{tid}/tokens/{revoked['id']}")
    other = await admin.tenant("other")
    foreign = await admin.ok("POST", f"/tenants/{other['id']}/tokens", {"name": "other"})
    quotas = {"requests_per_minute": 1, "tokens_per_minute": 1, "daily_neurons": 1}
    routes: list[tuple[str, str, Any]] = [
        ("POST", "/tenants", {"name": "m2", "plan": "paid"}),
        ("GET", "/tenants", None),
        ("GET", f"/tenants/{tid}", None),
        ("PATCH", f"/tenants/{tid}", {"plan": "paid"}),
        ("POST", f"/tenants/{tid}/tokens", {"name": "k"}),
        ("GET", f"/tenants/{tid}/tokens", None),
        ("PUT", f"/tenants/{tid}/quotas", quotas),
        ("PUT", f"/tenants/{tid}/models", {"allow": []}),
        ("GET", f"/tenants/{tid}/usage", None),
        ("GET", "/audit", None),
        ("DELETE", f"/tenants/{tid}/tokens/{live['id']}", None),
        ("DELETE", f"/tenants/{tid}", None),
    ]
    callers = {
        "no token": ({}, 401, 10000),
        "bad token": ({"authorization": "Bearer kumo_not_a_token"}, 401, 10000),
        "basic auth": ({"authorization": f"Basic {ADMIN_TOKEN}"}, 401, 10000),
        "revoked token": ({"authorization": f"Bearer {revoked['value']}"}, 401, 10000),
        "own tenant's token": ({"authorization": f"Bearer {live['value']}"}, 403, 9109),
        "other tenant's token": ({"authorization": f"Bearer {foreign['value']}"}, 403, 9109),
    }
    audit_before = (await admin.call("GET", "/audit")).json()["result_info"]["total_count"]
    for method, path, body in routes:
        for who, (headers, status, code) in callers.items():
            r = await admin.call(method, path, body, headers=headers)
            assert error_of(r)[:2] == (status, code), (who, method, path)
    assert (await admin.call("GET", "/audit")).json()["result_info"]["total_count"] == audit_before
    assert await admin.ok("GET", f"/tenants/{tid}") == tenant  # nothing changed
    for method, path, body in routes:
        await admin.ok(method, path, body)


async def test_unknown_admin_paths_and_methods(admin: Admin) -> None:
    assert error_of(await admin.call("GET", "/nothing-here"))[:2] == (404, 7000)
    assert error_of(await admin.call("PUT", "/tenants"))[:2] == (405, 7001)


async def test_an_oversized_body_is_refused(admin: Admin) -> None:
    huge = b'{"name": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}'
    r = await admin.http.post("/admin/v1/tenants", content=huge, headers=AUTH)
    status, code, message = error_of(r)
    assert (status, code) == (400, 6007) and "larger than" in message


async def test_a_token_is_only_revoked_through_its_own_tenant(admin: Admin) -> None:
    """BOLA (reliability §4.1): another tenant's path cannot reach a token, to revoke or list it."""
    owner, other = await admin.tenant("owner"), await admin.tenant("other")
    token = await admin.ok("POST", f"/tenants/{owner['id']}/tokens", {"name": "k"})
    r = await admin.call("DELETE", f"/tenants/{other['id']}/tokens/{token['id']}")
    assert error_of(r)[:2] == (404, 7000)
    assert await admin.ok("GET", f"/tenants/{other['id']}/tokens") == []
    ctx = await admin.services.authenticator.authenticate(f"Bearer {token['value']}", owner["id"])
    assert ctx.token_id == token["id"]  # still valid
    assert [t["revoked_at"] for t in await admin.ok("GET", f"/tenants/{owner['id']}/tokens")] == [None]
