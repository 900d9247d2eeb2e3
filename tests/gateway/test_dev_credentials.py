"""`kumo serve`'s development credentials across restarts of one data dir: each start opens the
store afresh on the same SQLite file, as a restarted process does."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest

from gateway.dev_credentials import DevCredentials, ensure_dev_credentials, read_credentials, write_private
from gateway.settings import GatewaySettings
from gateway.store.store import Store
from schemas.admin import TenantCreate, TokenCreate


@asynccontextmanager
async def started(
    data_dir: Path, admin_token: str | None = None
) -> AsyncIterator[tuple[Store, DevCredentials]]:
    """One `kumo serve` start's view: a store opened on the data dir and the credentials it prints."""
    settings = GatewaySettings(data_dir=data_dir, admin_token=admin_token)
    store = Store()
    await store.open(settings.sqlite_url)
    try:
        yield store, await ensure_dev_credentials(store, settings)
    finally:
        await store.close()


async def test_a_restart_keeps_the_account_and_both_tokens(tmp_path: Path) -> None:
    async with started(tmp_path) as (_, first):
        assert first.admin_token is not None and first.admin_token.startswith("kumo_admin_")
    async with started(tmp_path) as (store, second):
        assert second == first
        # finding the saved token is no use of it: `kumo admin tokens list` shows when it was used
        [token] = await store.list_tokens(first.account_id)
        assert token.last_used_at is None
        credential = await store.resolve_token(second.api_token)
        assert credential is not None and credential.tenant.id == first.account_id
        assert credential.tenant.plan == "paid"
        assert await store.resolve_admin(second.admin_token or "") == "admin:generated"
    file = tmp_path / "dev-credentials.json"
    assert stat.S_IMODE(file.stat().st_mode) == 0o600
    assert msgspec.json.decode(file.read_bytes(), type=DevCredentials) == first


async def test_a_revoked_token_is_not_brought_back(tmp_path: Path) -> None:
    async with started(tmp_path) as (store, first):
        credential = await store.resolve_token(first.api_token)
        assert credential is not None
        await store.revoke_token(first.account_id, credential.token_id, actor="admin:test")
    async with started(tmp_path) as (store, second):
        assert second.account_id == first.account_id and second.api_token != first.api_token
        assert await store.resolve_token(first.api_token) is None
        assert await store.resolve_token(second.api_token) is not None
    assert read_credentials(tmp_path / "dev-credentials.json") == second


async def test_a_lost_file_gets_a_fresh_token_and_the_old_one_revoked(tmp_path: Path) -> None:
    """Without the file the old value cannot be shown again, so it must not stay live either."""
    async with started(tmp_path) as (_, first):
        pass
    (tmp_path / "dev-credentials.json").unlink()
    async with started(tmp_path) as (store, second):
        assert second.account_id == first.account_id and second.api_token != first.api_token
        assert await store.resolve_token(first.api_token) is None
        # the generated admin token is still the store's, but its value is gone with the file
        assert second.admin_token is None
        assert await store.resolve_admin(first.admin_token or "") == "admin:generated"


async def test_an_admin_token_from_the_environment_is_never_written_down(tmp_path: Path) -> None:
    async with started(tmp_path) as (_, first):
        pass
    async with started(tmp_path, admin_token="kumo_admin_from_env") as (store, second):
        assert second.admin_token is None and second.api_token == first.api_token
        assert "kumo_admin_from_env" not in (tmp_path / "dev-credentials.json").read_text()
        assert await store.resolve_admin(first.admin_token or "") is None
    async with started(tmp_path) as (store, third):  # the environment's token is still the one
        assert third.admin_token is None
        assert await store.resolve_admin("kumo_admin_from_env") == "admin:env"


async def test_exporting_the_printed_admin_token_keeps_it(tmp_path: Path) -> None:
    """The announcement says `export KUMO_ADMIN_TOKEN=…`; a restart from that shell keeps it."""
    async with started(tmp_path) as (_, first):
        pass
    async with started(tmp_path, admin_token=first.admin_token) as (_, second):
        assert second == first
    async with started(tmp_path) as (store, third):
        assert third == first and await store.resolve_admin(first.admin_token or "") is not None


async def test_a_token_of_another_tenant_in_the_file_is_not_adopted(tmp_path: Path) -> None:
    async with started(tmp_path) as (store, first):
        other = await store.create_tenant(TenantCreate(name="someone"), actor="admin:test")
        theirs = await store.create_token(other.id, TokenCreate(name="kumo serve"), actor="admin:test")
    write_private(
        tmp_path / "dev-credentials.json",
        msgspec.json.encode(DevCredentials(first.account_id, theirs.value, first.admin_token)),
    )
    async with started(tmp_path) as (store, second):
        assert second.api_token not in (theirs.value, first.api_token)
        credential = await store.resolve_token(theirs.value)
        assert credential is not None and credential.tenant.id == other.id  # left alone


def test_the_file_is_owner_only_from_its_creation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    modes: list[int] = []
    real_open = os.open

    def spy(path: str | os.PathLike[str], flags: int, mode: int = 0o777) -> int:
        modes.append(mode)
        assert flags & os.O_EXCL and flags & os.O_CREAT
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", spy)
    old = os.umask(0)  # a permissive umask must not widen the file
    try:
        write_private(tmp_path / "f.json", b"{}")
    finally:
        os.umask(old)
    assert modes == [0o600]
    assert stat.S_IMODE((tmp_path / "f.json").stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]  # no staging file left behind
