"""Quota counters in the store, read and written inside a session the `Store` opens: the daily
neuron budget of gateways that share PostgreSQL without a Redis. A reservation locks the counter's
row (`SELECT … FOR UPDATE`), so concurrent reservations from every gateway are serialised on it and
none can pass a check that another has already used up."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from sqlalchemy import delete
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.store.rows import now
from gateway.store.tables import CounterRow

Verdict = Literal["admitted", "exhausted", "too_big", "unseeded"]


async def reserve(s: AsyncSession, key: str, amount: float, limit: float) -> Verdict:
    """Add `amount` to the counter unless that takes it past `limit` (negative: none): "exhausted"
    when it has already reached the limit, "too_big" when only `amount` does not fit, "unseeded"
    when the counter does not exist (the caller seeds it and asks again)."""
    row = await s.get(CounterRow, key, with_for_update=True)
    if row is None or row.expires_at <= now():
        return "unseeded"
    if limit >= 0 and row.value >= limit:
        return "exhausted"
    if limit >= 0 and row.value + amount > limit:
        return "too_big"
    row.value += amount
    return "admitted"


async def add_existing(s: AsyncSession, key: str, amount: float) -> bool:
    """Add `amount` (negative: a refund) to a counter that exists; whether it did."""
    row = await s.get(CounterRow, key, with_for_update=True)
    if row is None or row.expires_at <= now():
        return False
    row.value += amount
    return True


async def seed(s: AsyncSession, key: str, value: float, ttl_s: int, *, is_postgresql: bool) -> None:
    """Create the counter at `value` unless another gateway just did; drop expired counters."""
    await s.execute(delete(CounterRow).where(CounterRow.expires_at <= now()))
    values = {"key": key, "value": value, "expires_at": now() + dt.timedelta(seconds=ttl_s)}
    insert = pg_insert(CounterRow) if is_postgresql else sqlite_insert(CounterRow)
    await s.execute(insert.values(**values).on_conflict_do_nothing(index_elements=["key"]))
