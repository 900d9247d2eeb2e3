"""Fixtures for wrangler-mock: the fake gateway, in-process and on a port.

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
import threading  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
import uvicorn  # noqa: E402
from fake_workers_ai import ACCOUNT, TOKEN, FakeGateway  # noqa: E402
from wm_support import FAKE_BASE, free_port  # noqa: E402
from wrangler_mock.settings import Credentials  # noqa: E402


@pytest.fixture
def fake() -> FakeGateway:
    return FakeGateway()


@pytest.fixture
def credentials() -> Credentials:
    return Credentials(api_base_url=FAKE_BASE, api_token=TOKEN, account_id=ACCOUNT)


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
