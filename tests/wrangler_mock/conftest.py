"""Fixtures for wrangler-mock: the fake gateway (in-process and on a port) and served Workers.

`tests/wrangler_mock/` has the same name as the package it tests, and with `tests/` on sys.path
(pytest puts it there for `tests/conftest.py`) Python would resolve `import wrangler_mock` to this
folder as a namespace package. Importing the real package first, with `tests/` out of the way,
pins it in sys.modules.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
_saved_path = sys.path[:]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _TESTS]
try:
    import wrangler_mock  # noqa: F401
    import wrangler_mock.cli  # noqa: F401
finally:
    sys.path[:] = _saved_path

import asyncio  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
from collections.abc import AsyncIterator, Iterator  # noqa: E402
from contextlib import asynccontextmanager  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402
import uvicorn  # noqa: E402
from fake_workers_ai import ACCOUNT, TOKEN, FakeGateway  # noqa: E402
from wrangler_mock.config import WranglerConfig  # noqa: E402
from wrangler_mock.dev_server import build_app  # noqa: E402
from wrangler_mock.settings import Credentials  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "wrangler-mock" / "examples"
FAKE_BASE = "http://fake-gateway/client/v4"


@pytest.fixture
def fake() -> FakeGateway:
    return FakeGateway()


@pytest.fixture
def credentials() -> Credentials:
    return Credentials(api_base_url=FAKE_BASE, api_token=TOKEN, account_id=ACCOUNT)


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


@pytest.fixture(scope="session")
def fake_server() -> Iterator[tuple[str, FakeGateway]]:
    """The fake gateway on a real port (for subprocesses and the CLI), in a background thread."""
    gateway = FakeGateway(num_filler_models=100)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(gateway.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the fake gateway did not start")
        threading.Event().wait(0.02)
    yield f"http://127.0.0.1:{port}/client/v4", gateway
    server.should_exit = True
    thread.join(timeout=5)
