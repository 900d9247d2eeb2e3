"""Helpers shared by the wrangler-mock tests (a uniquely named module: `conftest` is ambiguous)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fake_workers_ai import FakeGateway
from wrangler_mock.config import WranglerConfig
from wrangler_mock.dev_server import build_app
from wrangler_mock.settings import Credentials

EXAMPLES = Path(__file__).resolve().parents[2] / "wrangler-mock" / "examples"
FAKE_BASE = "http://fake-gateway/client/v4"


@asynccontextmanager
async def served_worker(
    config: WranglerConfig, credentials: Credentials, gateway: FakeGateway
) -> AsyncIterator[httpx.AsyncClient]:
    """The Worker of `config`, lifespan running, its env.AI wired to `gateway` in-process."""
    app = build_app(config, credentials, transport=httpx.ASGITransport(app=gateway.app))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker.local") as client:
            yield client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
