"""Run the Alembic migrations in-process, on the store's own engine, at startup.

The alembic.ini equivalent is built here in code. On PostgreSQL a transaction-scoped advisory
lock serialises replicas that start together, so only one of them applies a revision.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import AsyncEngine

SCRIPT_LOCATION = Path(__file__).resolve().parent.parent / "migrations"
PG_LOCK_KEY = 0x6B756D6F  # "kumo"


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic `Config` for the store's migrations; `connection` is handed to `env.py`."""
    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    config.attributes["connection"] = connection
    return config


def _upgrade(connection: Connection) -> None:
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_LOCK_KEY})
    command.upgrade(alembic_config(connection), "head")


async def upgrade_to_head(engine: AsyncEngine) -> None:
    """Bring the database to the newest revision (idempotent)."""
    async with engine.begin() as connection:
        await connection.run_sync(_upgrade)
