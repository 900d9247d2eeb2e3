"""A real gateway (uvicorn, SQLite store) in front of scripted fake backends, one per test session.

Import `harness_fixture` into a test module. Pools: `kimi-k2.6` has two replicas (to test routing),
`glm-5.2` one, a legacy-family entry `@cf/kumo/legacy-test` one, and `@cf/kumo/mismatch` one whose
backend reports another architecture than its catalog entry.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fake_backend import FakeBackend, Served, serve

from gateway.app import create_app
from gateway.catalog import Catalog, load_catalog_file
from gateway.server import uvicorn_config
from gateway.services import Services, open_services
from gateway.settings import GatewaySettings
from schemas.admin import Quotas, TenantCreate, TokenCreate
from schemas.backend import GenerateRequest
from schemas.catalog import ModelSpec, PoolsFile, PoolSpec
from tests.child import dies_with_pytest

LEGACY = "@cf/kumo/legacy-test"
MISMATCH = "@cf/kumo/mismatch"
KIMI = "@cf/moonshotai/kimi-k2.6"
GLM = "@cf/zai-org/glm-5.2"


def extra_models() -> list[ModelSpec]:
    common = {"created_at": "2026-01-01 00:00:00.000", "author": "kumo", "default_max_tokens": 256}
    return [
        ModelSpec(
            id="00000000-0000-4000-8000-000000000001",
            name=LEGACY,
            description="legacy-family test entry",
            pool="legacy",
            family="legacy",
            architecture="Glm4MoeForCausalLM",
            price=load_catalog_file(None).models[1].price,
            **common,  # type: ignore[arg-type]
        ),
        ModelSpec(
            id="00000000-0000-4000-8000-000000000002",
            name=MISMATCH,
            description="an entry whose pool serves something else",
            pool="mismatch",
            architecture="GlmMoeDsaForCausalLM",
            experimental=True,
            **common,  # type: ignore[arg-type]
        ),
    ]


@dataclass
class Harness:
    url: str
    account: str
    token: str
    free_account: str
    free_token: str
    limited_account: str
    limited_token: str
    services: Services
    backends: dict[str, list[FakeBackend]]
    http: httpx.AsyncClient
    journal: list[GenerateRequest]

    def path(self, rest: str, account: str | None = None) -> str:
        return f"{self.url}/client/v4/accounts/{account or self.account}{rest}"

    def auth(self, token: str | None = None) -> dict[str, str]:
        return {"authorization": f"Bearer {token or self.token}"}

    @property
    def last(self) -> GenerateRequest:
        """The last request any fake backend received."""
        return self.journal[-1]


async def _tenant(services: Services, name: str, plan: str) -> tuple[str, str]:
    tenant = await services.store.create_tenant(TenantCreate(name=name, plan=plan), actor="test")  # type: ignore[arg-type]
    token = await services.store.create_token(tenant.id, TokenCreate(name="t"), actor="test")
    return tenant.id, token.value


@pytest.fixture(scope="session")
async def harness(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Harness]:
    journal: list[GenerateRequest] = []
    backends = {
        "kimi-k2.6": [FakeBackend("kimi-a", journal=journal), FakeBackend("kimi-b", journal=journal)],
        "glm-5.2": [FakeBackend("glm", architecture="GlmMoeDsaForCausalLM", vision=False, journal=journal)],
        "legacy": [FakeBackend("legacy", architecture="Glm4MoeForCausalLM", vision=False, journal=journal)],
        "mismatch": [FakeBackend("mismatch", architecture="LlamaForCausalLM", vision=False, journal=journal)],
    }
    served: list[Served] = []
    pools: dict[str, PoolSpec] = {}
    for pool, group in backends.items():
        urls = []
        for backend in group:
            s = await serve(backend.app())
            served.append(s)
            urls.append(s.url)
        pools[pool] = PoolSpec(replicas=urls, secret="fake-secret")
    data_dir: Path = tmp_path_factory.mktemp("kumo")
    settings = GatewaySettings(
        data_dir=data_dir,
        health_interval_s=0.2,
        max_body_bytes=256 * 1024,
        max_image_bytes=64 * 1024,
        body_read_timeout_s=1.0,
    )
    catalog = Catalog.from_file(load_catalog_file(None), extra_models())
    services = await open_services(settings, catalog, PoolsFile(pools=pools))
    account, token = await services.store.ensure_dev_tenant()
    free_account, free_token = await _tenant(services, "free-tenant", "free")
    limited_account, limited_token = await _tenant(services, "limited", "paid")
    await services.store.set_quotas(limited_account, Quotas(requests_per_minute=2), actor="test")
    app = create_app(settings, services)
    gateway = await serve(app, config=uvicorn_config(app, settings))  # the gateway's guarded server
    async with httpx.AsyncClient(timeout=30) as http:
        yield Harness(
            url=gateway.url,
            account=account,
            token=token,
            free_account=free_account,
            free_token=free_token,
            limited_account=limited_account,
            limited_token=limited_token,
            services=services,
            backends=backends,
            http=http,
            journal=journal,
        )
    await gateway.stop()
    for s in served:
        await s.stop()


@dataclass
class Standalone:
    """A `kumo gateway` process in front of the harness's fake backends, with one paid tenant."""

    url: str
    proc: asyncio.subprocess.Process
    http: httpx.AsyncClient
    account: str
    token: str


@asynccontextmanager
async def standalone_gateway(
    h: Harness, tmp_path: Path, *, admin_token: str, **env: str
) -> AsyncIterator[Standalone]:
    """Start `kumo gateway --pools` (pools file naming the fake replicas), wait for /healthz, create a
    tenant and a token through its admin API; kill the process on the way out if it still runs."""
    pools = ""
    for name in ("kimi-k2.6", "glm-5.2"):
        urls = ", ".join(f'"{r.url}"' for r in h.services.router.pools[name].replicas)
        pools += f'[pools."{name}"]\nreplicas = [{urls}]\nsecret = "fake-secret"\n'
    (tmp_path / "pools.toml").write_text(pools)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    proc_env = dict(os.environ, KUMO_ADMIN_TOKEN=admin_token, PYTHONPATH=str(root), **env)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "gateway", "--pools", str(tmp_path / "pools.toml"),
        "--port", str(port), "--data-dir", str(tmp_path / "data"),
        env=proc_env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        preexec_fn=dies_with_pytest(),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=20) as http:
            for _ in range(200):
                try:
                    if (await http.get(f"{url}/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
            admin = {"authorization": f"Bearer {admin_token}"}
            tenant = (
                await http.post(
                    f"{url}/admin/v1/tenants", headers=admin, json={"name": "acme", "plan": "paid"}
                )
            ).json()["result"]
            token = (
                await http.post(
                    f"{url}/admin/v1/tenants/{tenant['id']}/tokens", headers=admin, json={"name": "t"}
                )
            ).json()["result"]["value"]
            yield Standalone(url=url, proc=proc, http=http, account=tenant["id"], token=token)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
