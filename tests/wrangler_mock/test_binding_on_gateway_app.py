"""The binding and `ai` commands against the real gateway app (in-process, SQLite, no backends).

Without a backend the gateway still answers what the client side has to get right: the catalog
and its paging, authentication failures, unknown models and an unavailable pool, each in the
published wire format. Inference itself is covered end to end in test_kumo_serve.py.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from wrangler_mock.ai_binding import Ai
from wrangler_mock.ai_commands import format_models
from wrangler_mock.api import CloudflareApi
from wrangler_mock.errors import InferenceUpstreamError
from wrangler_mock.settings import Credentials

from gateway.app import create_app
from gateway.catalog import Catalog, load_catalog_file
from gateway.services import open_services
from gateway.settings import GatewaySettings
from schemas.catalog import PoolsFile, PoolSpec

UNREACHABLE = "http://127.0.0.1:9"  # discard port: nothing listens


@dataclass
class Gateway:
    transport: httpx.ASGITransport
    account: str
    token: str

    def api(self, client: httpx.AsyncClient, token: str | None = None) -> CloudflareApi:
        credentials = Credentials(
            api_base_url="http://kumo.local/client/v4", api_token=token or self.token, account_id=self.account
        )
        return CloudflareApi(credentials, client)


@pytest.fixture(scope="module")
async def gateway(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Gateway]:
    settings = GatewaySettings(data_dir=Path(tmp_path_factory.mktemp("kumo")), health_interval_s=0.2)
    catalog = Catalog.from_file(load_catalog_file(None), [])
    pools = PoolsFile(pools={m.pool: PoolSpec(replicas=[UNREACHABLE], secret="s") for m in catalog.models})
    services = await open_services(settings, catalog, pools)
    account, token = await services.store.ensure_dev_tenant()
    app = create_app(settings, services)
    async with app.router.lifespan_context(app):
        yield Gateway(httpx.ASGITransport(app=app), account, token)


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with CloudflareApi.make_client(gateway.transport) as client:
        yield client


async def test_catalog_pages_like_wrangler(gateway: Gateway, client: httpx.AsyncClient) -> None:
    api = gateway.api(client)
    entries = await api.list_models()
    names = {e["name"] for e in entries}
    assert {"@cf/moonshotai/kimi-k2.6", "@cf/zai-org/glm-5.2"} <= names
    for entry in entries:
        uuid.UUID(entry["id"])
        assert entry["task"]["name"] == "Text Generation"
    assert await api.search_models({"per_page": 50, "page": 2}) == []  # past the end: empty, so paging stops
    table = format_models(entries, as_json=False, out=io.StringIO())
    assert all(e["id"] in table and e["name"] in table for e in entries)


async def test_models_binding_searches(gateway: Gateway, client: httpx.AsyncClient) -> None:
    found = await Ai(gateway.api(client)).models({"search": "glm"})
    assert [m.name for m in found] == ["@cf/zai-org/glm-5.2"]


async def test_unknown_model_is_5007(gateway: Gateway, client: httpx.AsyncClient) -> None:
    with pytest.raises(InferenceUpstreamError) as caught:
        await Ai(gateway.api(client)).run("@cf/foo/bar", {"prompt": "hi"})
    assert (caught.value.status, caught.value.code) == (400, 5007)
    assert "No such model @cf/foo/bar" in caught.value.message


async def test_bad_token_is_10000(gateway: Gateway, client: httpx.AsyncClient) -> None:
    ai = Ai(gateway.api(client, token="not-a-token"))
    with pytest.raises(InferenceUpstreamError) as caught:
        await ai.run("@cf/moonshotai/kimi-k2.6", {"prompt": "hi"})
    assert (caught.value.status, caught.value.code) == (401, 10000)
    with pytest.raises(InferenceUpstreamError) as caught_stream:
        await ai.run("@cf/moonshotai/kimi-k2.6", {"prompt": "hi", "stream": True})
    assert caught_stream.value.code == 10000


async def test_no_replica_raises_instead_of_returning(gateway: Gateway, client: httpx.AsyncClient) -> None:
    with pytest.raises(InferenceUpstreamError) as caught:
        await Ai(gateway.api(client)).run("@cf/moonshotai/kimi-k2.6", {"prompt": "hi", "max_tokens": 4})
    assert (caught.value.status, caught.value.code) == (503, 3040), caught.value.errors
