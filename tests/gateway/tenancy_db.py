"""Databases for the tenancy tests: a SQLite file, and a fresh PostgreSQL database created through
the local `test` database and dropped afterwards (one per test module, so the suite stays fast).

Import the fixtures (`store_fixture`, `sqlite_store_fixture`) into a test module to use them. `KUMO_TEST_POSTGRES` overrides the server
(default `postgresql://postgres@127.0.0.1:5432`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from gateway.store import Store

POSTGRES = os.environ.get("KUMO_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432")
DIALECTS = ["sqlite", "postgresql"]


async def _admin_connection() -> asyncpg.Connection:
    return await asyncpg.connect(f"{POSTGRES}/test")


async def create_database(kind: str, tmp: Path) -> tuple[str, str | None]:
    """A URL to an empty database of `kind`, and the PostgreSQL database name to drop (if any)."""
    if kind == "sqlite":
        return f"sqlite+aiosqlite:///{tmp / f'kumo_{uuid.uuid4().hex[:8]}.db'}", None
    name = f"kumo_test_{uuid.uuid4().hex[:12]}"
    connection = await _admin_connection()
    try:
        await connection.execute(f'CREATE DATABASE "{name}"')
    finally:
        await connection.close()
    return f"{POSTGRES.replace('postgresql://', 'postgresql+asyncpg://')}/{name}", name


async def drop_database(name: str | None) -> None:
    if name is None:
        return
    connection = await _admin_connection()
    try:
        await connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await connection.close()


@pytest.fixture(name="store", scope="module", params=DIALECTS)
async def store_fixture(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Store]:
    """An opened, migrated store on SQLite and on PostgreSQL."""
    url, name = await create_database(request.param, tmp_path_factory.mktemp("db"))
    s = Store()
    await s.open(url)
    try:
        yield s
    finally:
        await s.close()
        await drop_database(name)


@pytest.fixture(name="sqlite_store", scope="module")
async def sqlite_store_fixture(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Store]:
    """A store on SQLite only, for tests about logic above the database."""
    url, _ = await create_database("sqlite", tmp_path_factory.mktemp("db"))
    s = Store()
    await s.open(url)
    try:
        yield s
    finally:
        await s.close()
