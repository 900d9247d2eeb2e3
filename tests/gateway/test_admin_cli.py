"""`kumo admin` against a real gateway admin API served by uvicorn on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Mount

from gateway.admin import admin_routes
from gateway.admin_cli import main
from gateway.app import render_error, render_http_error
from gateway.auth import Authenticator
from gateway.catalog import Catalog, load_catalog_file
from gateway.cli import main as kumo
from gateway.errors import KumoError
from gateway.store import Store

TOKEN = "cli-admin-token-0123456789abcdef"


@dataclass
class Services:
    store: Store
    authenticator: Authenticator
    catalog: Catalog


def admin_app(db: Path) -> Starlette:
    store = Store()
    services = Services(
        store=store, authenticator=Authenticator(store), catalog=Catalog.from_file(load_catalog_file(None))
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await store.open(f"sqlite+aiosqlite:///{db}")
        await store.ensure_admin_token(TOKEN)
        yield
        await store.close()

    return Starlette(
        routes=[Mount("/admin/v1", routes=admin_routes(services))],
        exception_handlers={KumoError: render_error, HTTPException: render_http_error},
        lifespan=lifespan,
    )


@pytest.fixture(name="url", scope="module")
def url_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = admin_app(tmp_path_factory.mktemp("cli") / "kumo.db")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "admin server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
    sock.close()


def run(url: str, capsys: pytest.CaptureFixture[str], *argv: str, token: str = TOKEN) -> tuple[int, Any, str]:
    code = main(["--url", url, *argv], env={"KUMO_ADMIN_TOKEN": token})
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err


def test_a_tenants_whole_life_from_the_shell(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, tenant, _ = run(url, capsys, "tenants", "create", "shell co", "--plan", "free")
    assert code == 0 and tenant["name"] == "shell co" and tenant["quotas"]["daily_neurons"] == 10000
    tid = tenant["id"]
    assert run(url, capsys, "tenants", "show", tid)[1] == tenant
    assert tid in [t["id"] for t in run(url, capsys, "tenants", "list", "--per-page", "100")[1]]
    assert run(url, capsys, "tenants", "update", tid, "--plan", "paid")[1]["plan"] == "paid"
    assert run(url, capsys, "tenants", "suspend", tid)[1]["suspended_at"] is not None
    assert run(url, capsys, "tenants", "resume", tid)[1]["suspended_at"] is None

    code, token, _ = run(
        url, capsys, "tokens", "create", tid, "laptop", "--expires-at", "2099-01-01T00:00:00Z"
    )
    assert code == 0 and token["value"].startswith("kumo_") and token["expires_at"] == "2099-01-01T00:00:00Z"
    assert [t["id"] for t in run(url, capsys, "tokens", "list", tid)[1]] == [token["id"]]
    assert run(url, capsys, "tokens", "revoke", tid, token["id"])[1]["revoked_at"] is not None

    quotas = ["--requests-per-minute", "30", "--tokens-per-minute", "none", "--daily-neurons", "2500.5"]
    assert run(url, capsys, "quotas", tid, *quotas)[1] == {
        "requests_per_minute": 30,
        "tokens_per_minute": None,
        "daily_neurons": 2500.5,
    }
    # one quota at a time: the others are kept
    assert run(url, capsys, "quotas", tid, "--tokens-per-minute", "9000")[1] == {
        "requests_per_minute": 30,
        "tokens_per_minute": 9000,
        "daily_neurons": 2500.5,
    }
    assert run(url, capsys, "quotas", tid, "--requests-per-minute", "none")[1]["requests_per_minute"] is None
    models = ["@cf/zai-org/glm-5.2", "@cf/moonshotai/kimi-k2.6"]
    assert run(url, capsys, "models", tid, "--allow", *models)[1] == {"allow": sorted(models)}
    assert run(url, capsys, "models", tid, "--all")[1] == {"allow": None}
    assert run(url, capsys, "usage", tid, "--group-by", "model", "--since", "2026-01-01")[1] == []

    actions = [e["action"] for e in run(url, capsys, "audit", "--tenant-id", tid)[1]]
    assert actions[0] == "tenant.models" and actions[-1] == "tenant.create" and len(actions) == 11

    assert run(url, capsys, "tenants", "delete", tid)[1] == {"id": tid}
    code, _, err = run(url, capsys, "tenants", "show", tid)
    assert code == 1 and err.startswith("error 7000:")


def test_errors_reach_the_shell(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(url, capsys, "tenants", "list", token="wrong")
    assert code == 1 and "error 10000: Authentication error" in err
    code, _, err = run(url, capsys, "usage", "0" * 32, "--since", "2026-13-01")
    assert code == 1 and "error 6007" in err
    assert main(["--url", url, "tenants", "list"], env={}) == 2
    assert "KUMO_ADMIN_TOKEN" in capsys.readouterr().err
    code, _, err = run("http://127.0.0.1:9", capsys, "audit")
    assert code == 1 and "cannot reach" in err
    with pytest.raises(SystemExit) as exit_:
        run(url, capsys, "quotas", "0" * 32)  # nothing to change
    assert exit_.value.code == 2 and "give at least one of --requests-per-minute" in capsys.readouterr().err
    for flag, value, said in (
        ("--daily-neurons", "lots", "a number"),
        ("--requests-per-minute", "1.5", "a whole number"),
    ):
        with pytest.raises(SystemExit):
            run(url, capsys, "quotas", "0" * 32, flag, value)
        err = capsys.readouterr().err  # in the shell's words, not the parser's function's name
        assert (
            f"expected {said} or 'none', got '{value}'" in err
            and "_neurons" not in err
            and "_limit" not in err
        )


def test_the_kumo_dispatcher_runs_admin(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUMO_ADMIN_TOKEN", TOKEN)
    assert kumo(["admin", "--url", url, "audit", "--per-page", "1"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), list)
    assert kumo(["admin", "tenants", "list", "--url", url]) == 0  # --url after the command works too
    assert isinstance(json.loads(capsys.readouterr().out), list)
