"""Quota counters in the store, read and written inside a session the `Store` opens: the daily
neuron budget of gateways that share PostgreSQL without a Redis. A reservation locks the counter's
row (`SELECT … FOR UPDATE`), so concurrent reservations from every gateway are serialised on it and
none can pass a check that another has already used up.

A counter's generation is set when it is seeded; a settlement leaves a marker row (its key, value 0,
kept a few minutes) in the same transaction, so a retry after a lost reply finds it and adds nothing.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Literal

from sqlalchemy import delete
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.store.rows import now
from gateway.store.tables import CounterRow

Verdict = Literal["admitted", "exhausted", "too_big", "unseeded"]
Settled = Literal["settled", "settled_before", "no_counter", "reseeded"]


async def reserve(s: AsyncSession, key: str, amount: float, limit: float) -> tuple[Verdict, str]:
    """Add `amount` to the counter unless that takes it past `limit` (negative: none): "exhausted"
    when it has already reached the limit, "too_big" when only `amount` does not fit, "unseeded"
    when the counter does not exist (the caller seeds it and asks again). With the verdict, the
    generation of the counter added to ("" otherwise)."""
    row = await s.get(CounterRow, key, with_for_update=True)
    if row is None or row.expires_at <= now():
        return "unseeded", ""
    if limit >= 0 and row.value >= limit:
        return "exhausted", ""
    if limit >= 0 and row.value + amount > limit:
        return "too_big", ""
    row.value += amount
    return "admitted", row.generation or ""


async def settle(
    s: AsyncSession, key: str, marker: str, amounts: Mapping[str, float], marker_ttl_s: int
) -> tuple[Settled, str]:
    """Once per `marker`: add `amounts[g]` to the counter if its generation `g` is listed; with the
    verdict, the counter's generation. The counter's row is locked before the marker is looked
    for, so a retry waits for an attempt still committing and then sees its marker."""
    row = await s.get(CounterRow, key, with_for_update=True)
    if await s.get(CounterRow, marker) is not None:
        return "settled_before", ""
    if row is None or row.expires_at <= now():
        return "no_counter", ""
    generation = row.generation or ""
    if generation not in amounts:
        return "reseeded", generation
    row.value += amounts[generation]
    s.add(CounterRow(key=marker, value=0.0, expires_at=now() + dt.timedelta(seconds=marker_ttl_s)))
    return "settled", generation


async def seed(
    s: AsyncSession, key: str, value: float, ttl_s: int, generation: str, *, is_postgresql: bool
) -> str:
    """Create the counter at `value`, of `generation`, unless another gateway just did; drop
    expired counters. Returns the generation of the counter there now."""
    await sweep(s)
    values = {
        "key": key,
        "value": value,
        "generation": generation,
        "expires_at": now() + dt.timedelta(seconds=ttl_s),
    }
    insert = pg_insert(CounterRow) if is_postgresql else sqlite_insert(CounterRow)
    await s.execute(insert.values(**values).on_conflict_do_nothing(index_elements=["key"]))
    row = await s.get(CounterRow, key)
    return "" if row is None or row.generation is None else row.generation


async def sweep(s: AsyncSession) -> None:
    """Delete expired counters and settlement markers."""
    await s.execute(delete(CounterRow).where(CounterRow.expires_at <= now()))
