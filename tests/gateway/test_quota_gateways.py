"""Two real gateways (uvicorn) sharing one PostgreSQL database and one Redis, in front of a fake
backend: the scale-out deployment. Quotas are exact across both, a token revoked on one stops
working on the other within the cache window, and usage recorded by one is visible on the other."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from fake_backend import FakeBackend, Served, serve
from tenancy_db import create_database, drop_database

from gateway.app import create_app
from gateway.catalog import Catalog, load_catalog_file
from gateway.quotas import make_limiter
from gateway.services import open_services
from gateway.settings import GatewaySettings
from schemas.catalog import PoolsFile, PoolSpec

REDIS_URL = "redis://127.0.0.1:6379/0"
ADMIN = f"admin-{uuid.uuid4().hex}"
KIMI = "@cf/moonshotai/kimi-k2.6"


@dataclass
class Pair:
    urls: list[str]
    http: httpx.AsyncClient

    async def admin(self, gateway: int, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        r = await self.http.request(
            method,
            f"{self.urls[gateway]}/admin/v1{path}",
            json=body,
            headers={"authorization": f"Bearer {ADMIN}"},
            **kw,
        )
        assert r.status_code == 200, r.text
        return r.json()["result"]

    async def run(self, gateway: int, account: str, token: str, text: str = "hi") -> httpx.Response:
        return await self.http.post(
            f"{self.urls[gateway]}/client/v4/accounts/{account}/ai/run/{KIMI}",
            headers={"authorization": f"Bearer {token}"},
            json={"messages": [{"role": "user", "content": text}], "max_tokens": 16},
        )

    async def tenant(self, **quotas: float | None) -> tuple[str, str]:
        """A paid tenant created through gateway 0, with these quotas, and a token for it."""
        tenant = await self.admin(0, "POST", "/tenants", {"name": "scale-out", "plan": "paid"})
        full = {"requests_per_minute": None, "tokens_per_minute": None, "daily_neurons": None, **quotas}
        await self.admin(0, "PUT", f"/tenants/{tenant['id']}/quotas", full)
        token = await self.admin(0, "POST", f"/tenants/{tenant['id']}/tokens", {"name": "k"})
        return tenant["id"], token["value"]


@pytest.fixture(name="pair", scope="module")
async def pair_fixture(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pair]:
    tmp: Path = tmp_path_factory.mktemp("pair")
    backends = [FakeBackend("kimi"), FakeBackend("glm", architecture="GlmMoeDsaForCausalLM", vision=False)]
    served: list[Served] = [await serve(b.app()) for b in backends]
    pools = PoolsFile(
        pools={
            "kimi-k2.6": PoolSpec(replicas=[served[0].url], secret="fake-secret"),
            "glm-5.2": PoolSpec(replicas=[served[1].url], secret="fake-secret"),
        }
    )
    database_url, database = await create_database("postgresql", tmp)
    prefix = f"kumo-test-{uuid.uuid4().hex[:10]}:"
    settings = GatewaySettings(
        data_dir=tmp, database_url=database_url, redis_url=REDIS_URL, health_interval_s=0.2
    )
    catalog = Catalog.from_file(load_catalog_file(None))
    gateways: list[Served] = []
    for _ in range(2):
        services = await open_services(settings, catalog, pools)
        await services.limiter.close()
        services.limiter = make_limiter(REDIS_URL, services.store, prefix=prefix)  # this run's own keys
        await services.store.ensure_admin_token(ADMIN)
        gateways.append(await serve(create_app(settings, services)))
    async with httpx.AsyncClient(timeout=30) as http:
        yield Pair(urls=[g.url for g in gateways], http=http)
    for s in [*gateways, *served]:
        await s.stop()
    client = aioredis.Redis.from_url(REDIS_URL)
    keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()
    await drop_database(database)


async def test_requests_per_minute_are_exact_across_two_gateways(pair: Pair) -> None:
    account, token = await pair.tenant(requests_per_minute=6)
    if time.time() % 60 > 50:  # keep the burst inside one minute window
        await asyncio.sleep(61 - time.time() % 60)
    responses = await asyncio.gather(*(pair.run(i % 2, account, token) for i in range(12)))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 6 + [429] * 6, [r.text for r in responses]
    refused = [r for r in responses if r.status_code == 429]
    assert {r.json()["errors"][0]["code"] for r in refused} == {3021}
    assert all(1 <= int(r.headers["retry-after"]) <= 60 for r in refused)
    assert {r.request.url.host for r in refused} == {"127.0.0.1"} and len(
        {r.request.url.port for r in refused}
    ) == 2


async def test_the_daily_neuron_allowance_is_shared(pair: Pair) -> None:
    # each request reserves its worst case (~17 neurons) and costs ~2.2 (12 prompt + 4 completion
    # tokens of Kimi K2.6): gateway 0 serves until what is left cannot hold another worst case
    account, token = await pair.tenant(daily_neurons=30)
    num_served = 0
    while (r := await pair.run(0, account, token, "spend")).status_code == 200:
        num_served += 1
        assert num_served < 20, "the allowance is not enforced"
    assert r.status_code == 429 and r.json()["errors"][0]["code"] == 3036, r.text
    assert num_served >= 2  # the unused part of each reservation was refunded
    second = await pair.run(1, account, token, "spend")  # the same request on the other gateway
    assert second.status_code == 429 and second.json()["errors"][0]["code"] == 3036


async def test_a_token_revoked_on_one_gateway_stops_on_the_other_within_seconds(pair: Pair) -> None:
    account, token = await pair.tenant()
    warm = await pair.run(1, account, token)  # now cached on gateway 1
    assert warm.status_code == 200, warm.text
    [listed] = await pair.admin(1, "GET", f"/tenants/{account}/tokens")
    await pair.admin(0, "DELETE", f"/tenants/{account}/tokens/{listed['id']}")
    revoked_at = time.monotonic()
    while (r := await pair.run(1, account, token)).status_code == 200:
        assert time.monotonic() - revoked_at < 3.0, "gateway 1 honoured a revoked token for too long"
        await asyncio.sleep(0.1)
    assert r.status_code == 401 and r.json()["errors"][0]["code"] == 10000
    assert (await pair.run(0, account, token)).status_code == 401


async def test_usage_served_by_one_gateway_is_visible_on_the_other(pair: Pair) -> None:
    account, token = await pair.tenant()
    for i in range(3):
        r = await pair.run(i % 2, account, token)
        assert r.status_code == 200, r.text
    today = dt.datetime.now(dt.UTC).date().isoformat()
    deadline = time.monotonic() + 5
    while True:  # each gateway's ledger writes within about a second
        rows = await pair.admin(
            1, "GET", f"/tenants/{account}/usage", params={"since": today, "group_by": "model"}
        )
        if rows and rows[0]["requests"] == 3 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert [(r["model"], r["requests"]) for r in rows] == [(KIMI, 3)]
    assert rows[0]["prompt_tokens"] > 0 and rows[0]["neurons"] > 0
