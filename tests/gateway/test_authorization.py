# ruff: noqa: F811  (pytest fixtures imported by name)
"""Every public route × every kind of caller: no token, a bad token, a revoked token, another
tenant's token, the admin token, the account's own token (reference §3.1, §6; reliability §4.1)."""

from __future__ import annotations

import datetime as dt

import httpx
from gateway_harness import GLM, KIMI, Harness, harness  # noqa: F401  (fixture)
from structlog.testing import capture_logs

from schemas.admin import TenantCreate, TokenCreate

ADMIN = "kumo_admin_test_token_value_0123456789"


def routes(h: Harness) -> list[tuple[str, str, dict | None]]:  # type: ignore[type-arg]
    chat = {"model": GLM, "messages": [{"role": "user", "content": "x"}]}
    return [
        ("POST", h.path(f"/ai/run/{GLM}"), {"prompt": "x"}),
        ("POST", h.path("/ai/run"), {"model": GLM, "input": {"prompt": "x"}}),
        ("POST", h.path("/ai/v1/chat/completions"), chat),
        ("GET", h.path("/ai/v1/models"), None),
        ("GET", h.path("/ai/models/search"), None),
        ("GET", h.path(f"/ai/models/schema?model={GLM}"), None),
        ("GET", h.path("/ai/tasks/search"), None),
        ("GET", h.path("/ai/authors/search"), None),
    ]


async def call(h: Harness, method: str, url: str, body: object, token: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return await h.http.request(method, url, headers=headers, json=body)


async def test_every_route_and_every_caller(harness: Harness) -> None:
    store = harness.services.store
    await store.ensure_admin_token(ADMIN)
    revoked = await store.create_token(harness.account, TokenCreate(name="to-revoke"), actor="test")
    await store.revoke_token(harness.account, revoked.id, actor="test")
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    expired = await store.create_token(
        harness.account, TokenCreate(name="expired", expires_at=past), actor="test"
    )
    gone = await store.create_tenant(TenantCreate(name="deleted", plan="paid"), actor="test")
    gone_token = await store.create_token(gone.id, TokenCreate(name="t"), actor="test")
    await store.delete_tenant(gone.id, actor="test")
    unauthenticated = {
        "none": (None, 401, 10000),
        "bad": ("kumo_not_a_token", 401, 10000),
        "forged id": (f"kumo_{revoked.id}_forged", 401, 10000),
        "revoked": (revoked.value, 401, 10000),
        "expired": (expired.value, 401, 10000),
        "deleted tenant": (gone_token.value, 401, 10000),
        "admin": (ADMIN, 401, 10000),
    }
    callers = {**unauthenticated, "other tenant": (harness.free_token, 403, 10000)}
    for method, url, body in routes(harness):
        for who, (token, status, code) in callers.items():
            r = await call(harness, method, url, body, token)
            assert r.json()["success"] is False and r.json()["result"] is None, (who, url, r.text)
            assert (r.status_code, r.json()["errors"][0]["code"]) == (status, code), (who, url, r.text)
        own = await call(harness, method, url, body, harness.token)
        assert own.status_code == 200, (url, own.text)
    memberships = f"{harness.url}/client/v4/memberships"
    for who, (token, status, code) in unauthenticated.items():
        r = await call(harness, "GET", memberships, None, token)
        assert (r.status_code, r.json()["errors"][0]["code"]) == (status, code), (who, r.text)
    for token, account in ((harness.token, harness.account), (harness.free_token, None)):
        r = await call(harness, "GET", memberships, None, token)
        accounts = [m["account"]["id"] for m in r.json()["result"]]
        assert r.status_code == 200 and len(accounts) == 1, r.text
        assert (accounts[0] == account) if account else (accounts[0] != harness.account)
    admin_view = await harness.http.get(
        f"{harness.url}/admin/v1/tenants", headers={"authorization": f"Bearer {ADMIN}"}
    )
    assert admin_view.status_code == 200
    tenant_on_admin = await harness.http.get(f"{harness.url}/admin/v1/tenants", headers=harness.auth())
    assert tenant_on_admin.status_code == 403


async def test_one_json_log_line_per_request_without_secrets(harness: Harness) -> None:
    with capture_logs() as logs:
        await harness.http.post(
            harness.path(f"/ai/run/{GLM}"), headers=harness.auth(), json={"prompt": "log me"}
        )
    lines = [entry for entry in logs if entry["event"] == "request"]
    assert len(lines) == 1
    line = lines[0]
    assert line["status"] == 200 and line["model"] == GLM and line["tenant"] == harness.account
    assert line["replica"].startswith("http://127.0.0.1:") and line["completion_tokens"] > 0
    assert harness.token not in str(logs)


async def test_a_model_outside_the_allow_list_is_403_5018(harness: Harness) -> None:
    store = harness.services.store
    tenant = await store.create_tenant(TenantCreate(name="glm-only", plan="paid"), actor="test")
    token = await store.create_token(tenant.id, TokenCreate(name="t"), actor="test")
    await store.set_models(tenant.id, [GLM], actor="test")
    headers = {"authorization": f"Bearer {token.value}"}
    denied = await harness.http.post(
        harness.path(f"/ai/run/{KIMI}", account=tenant.id), headers=headers, json={"prompt": "x"}
    )
    assert denied.status_code == 403 and denied.json()["errors"][0]["code"] == 5018
    allowed = await harness.http.post(
        harness.path(f"/ai/run/{GLM}", account=tenant.id), headers=headers, json={"prompt": "x"}
    )
    assert allowed.status_code == 200
    # the catalog it searches lists what it may run, as /ai/v1/models does
    found = await harness.http.get(harness.path("/ai/models/search", account=tenant.id), headers=headers)
    assert [m["name"] for m in found.json()["result"]] == [GLM]
    assert found.json()["result_info"]["total_count"] == 1
    listed = await harness.http.get(harness.path("/ai/v1/models", account=tenant.id), headers=headers)
    assert [m["id"] for m in listed.json()["data"]] == [GLM]
    # and its schemas: a model it may not use is unknown there too (it once served it whole)
    for model, status in ((GLM, 200), (KIMI, 400)):
        schema = await harness.http.get(
            harness.path(f"/ai/models/schema?model={model}", account=tenant.id), headers=headers
        )
        assert schema.status_code == status, schema.text
    assert schema.json()["errors"][0]["code"] == 5007
