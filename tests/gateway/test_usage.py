"""Neuron pricing against the published conversion (reference §5, §8) and the usage ledger's
background writes: never on the response path, at most about `flush_seconds` behind, no loss."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import Sequence

import pytest
from sqlalchemy import func, select
from tenancy_db import sqlite_store_fixture  # noqa: F401  (fixture)

from gateway.auth import Authenticator
from gateway.errors import NeuronsExhausted
from gateway.quotas import make_limiter
from gateway.store import Store
from gateway.store.tables import UsageRow
from gateway.usage import UsageLedger, neurons
from schemas.admin import TenantCreate, TokenCreate, UsageRecord
from schemas.catalog import Price

KIMI_K2_6 = [
    Price(unit="per M input tokens", price=0.95),
    Price(unit="per M output tokens", price=4.0),
    Price(unit="per M cached input tokens", price=0.16),
]
GLM_4_7_FLASH = [
    Price(unit="per M input tokens", price=0.0605),
    Price(unit="per M output tokens", price=0.40),
]


def test_neurons_match_the_published_per_million_figures() -> None:
    # reference §5: kimi-k2.6 is 86,364 · 363,636 · 14,545 neurons per M input · output · cached input
    assert neurons(KIMI_K2_6, 1_000_000, 0, 0) == pytest.approx(86_364, abs=0.5)
    assert neurons(KIMI_K2_6, 0, 0, 1_000_000) == pytest.approx(363_636, abs=0.5)
    assert neurons(KIMI_K2_6, 1_000_000, 1_000_000, 0) == pytest.approx(14_545, abs=0.5)
    # prompt_tokens includes the cached ones, billed at the cached price
    mixed = (600 * 86_363.64 + 400 * 14_545.45 + 200 * 363_636.36) / 1e6
    assert neurons(KIMI_K2_6, 1000, 400, 200) == pytest.approx(mixed, rel=1e-6)
    # glm-4.7-flash: 5,500 · 36,364 (listed 36,400 from a rounded price); no cached price → input price
    assert neurons(GLM_4_7_FLASH, 1_000_000, 0, 0) == pytest.approx(5_500, abs=0.5)
    assert neurons(GLM_4_7_FLASH, 1_000_000, 500_000, 0) == neurons(GLM_4_7_FLASH, 1_000_000, 0, 0)
    assert neurons([], 10, 0, 10) == 0.0


def test_the_free_allowance_buys_what_workers_ai_says() -> None:
    # 10,000 neurons/day ≈ 115,789 kimi-k2.6 input tokens (10,000 / 86,364 per M)
    assert neurons(KIMI_K2_6, 115_789, 0, 0) == pytest.approx(10_000, rel=1e-4)


def record(tenant_id: str, i: int, **kw: object) -> UsageRecord:
    return UsageRecord(tenant_id=tenant_id, model="@cf/m", request_id=f"r{i}", prompt_tokens=1, **kw)  # type: ignore[arg-type]


async def test_records_land_within_the_flush_interval(sqlite_store: Store) -> None:
    tenant_id = uuid.uuid4().hex
    await sqlite_store.add_usage([record(tenant_id, -1)])
    ledger = UsageLedger(sqlite_store, flush_seconds=0.05)
    await ledger.start()
    for i in range(5):
        ledger.record(record(tenant_id, i))
    assert ledger.num_pending == 5  # nothing was written on the caller's path
    for _ in range(100):
        if ledger.num_pending == 0 and await total_requests_any(sqlite_store, tenant_id) == 6:
            break
        await asyncio.sleep(0.02)
    assert await total_requests_any(sqlite_store, tenant_id) == 6
    await ledger.stop()


async def total_requests_any(store: Store, tenant_id: str) -> int:
    """Rows of `tenant_id` in the ledger table (no tenant row needed)."""
    async with store.engine.connect() as connection:
        count = await connection.scalar(select(func.count()).where(UsageRow.tenant_id == tenant_id))
    return int(count or 0)


async def test_a_full_batch_is_written_early_and_stop_writes_the_rest(sqlite_store: Store) -> None:
    tenant_id = uuid.uuid4().hex
    ledger = UsageLedger(sqlite_store, flush_seconds=60, max_batch=3)
    await ledger.start()
    for i in range(3):
        ledger.record(record(tenant_id, i))
    for _ in range(100):
        if await total_requests_any(sqlite_store, tenant_id) == 3:
            break
        await asyncio.sleep(0.02)
    assert await total_requests_any(sqlite_store, tenant_id) == 3
    ledger.record(record(tenant_id, 3))
    await ledger.stop()
    assert await total_requests_any(sqlite_store, tenant_id) == 4 and ledger.num_pending == 0


class FlakyStore(Store):
    """A store whose first write fails, as a dropped database connection would."""

    def __init__(self, real: Store) -> None:
        super().__init__()
        self._real = real
        self.num_failures = 0

    async def add_usage(self, records: Sequence[UsageRecord]) -> None:
        if self.num_failures == 0:
            self.num_failures += 1
            raise ConnectionError("database went away")
        await self._real.add_usage(records)


async def test_a_failed_write_is_retried_without_loss_or_duplicates(sqlite_store: Store) -> None:
    tenant_id = uuid.uuid4().hex
    ledger = UsageLedger(FlakyStore(sqlite_store), flush_seconds=60)
    for i in range(3):
        ledger.record(record(tenant_id, i, neurons=0.5))
    await ledger.flush()
    assert ledger.num_pending == 3 and await total_requests_any(sqlite_store, tenant_id) == 0
    await ledger.flush()
    assert ledger.num_pending == 0 and await total_requests_any(sqlite_store, tenant_id) == 3
    assert await sqlite_store.neurons_on(tenant_id, dt.datetime.now(dt.UTC).date()) == pytest.approx(1.5)


class SlowStore(Store):
    """A store whose writes wait until the test lets them through."""

    def __init__(self, real: Store) -> None:
        super().__init__()
        self._real = real
        self.writing = asyncio.Event()
        self.proceed = asyncio.Event()

    async def add_usage(self, records: Sequence[UsageRecord]) -> None:
        self.writing.set()
        await self.proceed.wait()
        await self._real.add_usage(records)


async def test_a_flush_waits_for_the_batch_the_background_task_is_writing(sqlite_store: Store) -> None:
    # the neuron-budget test read usage short under load: its flush found the queue empty while the
    # background task's batch was still being written, and returned at once
    tenant_id = uuid.uuid4().hex
    store = SlowStore(sqlite_store)
    ledger = UsageLedger(store, flush_seconds=0.01)
    await ledger.start()
    ledger.record(record(tenant_id, 0, neurons=2.0))
    await asyncio.wait_for(store.writing.wait(), 5)  # the background task holds the batch
    assert ledger.num_pending == 0
    flushing = asyncio.create_task(ledger.flush())
    await asyncio.sleep(0.05)
    assert not flushing.done()  # before: returned here with nothing written
    store.proceed.set()
    await asyncio.wait_for(flushing, 5)
    assert await sqlite_store.neurons_on(tenant_id, dt.datetime.now(dt.UTC).date()) == pytest.approx(2.0)
    await ledger.stop()


async def test_a_free_tenant_spends_its_daily_neurons_on_kimi(sqlite_store: Store) -> None:
    """Admit → serve → price → settle → ledger, as the inference path does it, until the free
    plan's 10,000 neurons are gone; the ledger then shows exactly what was spent."""
    tenant = await sqlite_store.create_tenant(TenantCreate(name="free user", plan="free"), actor="admin:test")
    token = await sqlite_store.create_token(tenant.id, TokenCreate(name="k"), actor="admin:test")
    ctx = await Authenticator(sqlite_store).authenticate(f"Bearer {token.value}", tenant.id)
    limiter, ledger = make_limiter(None, sqlite_store), UsageLedger(sqlite_store, flush_seconds=60)
    served = 0
    with pytest.raises(NeuronsExhausted) as caught:
        for i in range(10):
            admission = await limiter.admit(ctx, "@cf/moonshotai/kimi-k2.6", 50_256)
            spent = neurons(KIMI_K2_6, 50_000, 10_000, 256)  # ≈ 3,693 neurons
            await limiter.settle(admission, tokens=50_256, neurons=spent)
            ledger.record(record(tenant.id, i, cached_tokens=10_000, completion_tokens=256, neurons=spent))
            served += 1
    assert served == 3  # 2 × 3,693 < 10,000 ≤ 3 × 3,693
    assert caught.value.code == 3036 and "10,000 neurons" in caught.value.message
    await ledger.stop()
    today = dt.datetime.now(dt.UTC).date()
    [row] = await sqlite_store.usage(tenant.id, since=today, until=today, group_by="day")
    assert row.requests == 3 and row.neurons == pytest.approx(3 * neurons(KIMI_K2_6, 50_000, 10_000, 256))
    await limiter.close()


async def test_a_long_outage_bounds_memory_and_counts_what_it_dropped(sqlite_store: Store) -> None:
    tenant_id = uuid.uuid4().hex
    store = FlakyStore(sqlite_store)
    ledger = UsageLedger(store, flush_seconds=60, max_batch=1000, max_pending=5)
    for i in range(8):
        ledger.record(record(tenant_id, i))
    assert (ledger.num_pending, ledger.num_dropped) == (5, 3)
    await ledger.flush()  # fails: the database is away
    await ledger.flush()
    async with sqlite_store.engine.connect() as connection:
        kept = await connection.scalars(select(UsageRow.request_id).where(UsageRow.tenant_id == tenant_id))
        assert sorted(kept) == ["r3", "r4", "r5", "r6", "r7"]  # the newest survive
