"""Settling the day's neurons when the counters fail, in-process, in Redis and in PostgreSQL: a
settle that fails is tried again in the background until the reservation is released; an attempt
whose reply was lost after it ran is not applied again; and a counter re-seeded from the ledger
between admission and settle (a flushed or restarted Redis) neither takes a refund of a reservation
it never held nor counts a response twice; nor does a Redis counter brought back from a snapshot
taken before the admission (its hold is not there).

The counters fail through `Flaky`, which wraps the real ones: what cannot be made on demand is a
reply lost after the command ran."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import redis.asyncio as aioredis
from sqlalchemy import delete, select
from tenancy_db import create_database, drop_database, sqlite_store_fixture  # noqa: F401  (fixture)

from gateway import quotas
from gateway.auth import TenantContext
from gateway.errors import NeuronsExhausted
from gateway.quota_counters import (
    NO_COUNTER,
    RESEEDED,
    SETTLED,
    SETTLED_BEFORE,
    Counters,
    MemoryCounters,
    PostgresCounters,
    RedisCounters,
    Settlement,
)
from gateway.quotas import Admission, Limiter
from gateway.store import Store
from gateway.store.tables import CounterRow
from schemas.admin import Quotas, UsageRecord

REDIS_URL = "redis://127.0.0.1:6379/0"
RETRY_DELAYS_S = (0.02, 0.05, 0.1, 0.2, 1.0)  # the gateway's take about a minute
KINDS = ["memory", "redis", "postgresql"]


class Flaky:
    """Counters that fail on demand, the way an unreachable Redis or database does: while
    `is_down` every call fails before it reaches them, while `are_settles_down` only settlements
    do; the next `num_lost_replies` settlements run and then fail, as if the reply was lost.
    `verdicts` lists what every settlement that ran answered."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self.is_down = False
        self.are_settles_down = False
        self.num_lost_replies = 0
        self.verdicts: list[int] = []

    def _fail_if_down(self) -> None:
        if self.is_down:
            raise ConnectionError("the counters went away")

    async def reserve(
        self,
        keys: tuple[str, str, str],
        limits: tuple[int, int, float],
        tokens: int,
        neurons: float,
        hold: str,
    ) -> tuple[int, str]:
        self._fail_if_down()
        return await self.counters.reserve(keys, limits, tokens, neurons, hold)

    async def add(self, key: str, amount: float, ttl: int) -> None:
        self._fail_if_down()
        await self.counters.add(key, amount, ttl)

    async def settle(self, settlement: Settlement) -> tuple[int, str]:
        self._fail_if_down()
        if self.are_settles_down:
            raise ConnectionError("the counters went away")
        verdict, generation = await self.counters.settle(settlement)
        self.verdicts.append(verdict)
        if self.num_lost_replies > 0:
            self.num_lost_replies -= 1
            raise ConnectionError("the reply was lost")
        return verdict, generation

    async def seed(self, key: str, value: float, ttl: int) -> str:
        self._fail_if_down()
        return await self.counters.seed(key, value, ttl)

    async def close(self) -> None:
        await self.counters.close()


@dataclass
class Gateway:
    """A limiter over flaky counters of one kind, and the store whose ledger seeds them."""

    kind: str
    store: Store
    prefix: str
    flaky: Flaky
    limiter: Limiter = field(init=False)

    def __post_init__(self) -> None:
        self.limiter = Limiter(
            self.flaky, self.store, prefix=self.prefix, settle_retry_delays_s=RETRY_DELAYS_S
        )

    async def spent(self, who: TenantContext) -> float:
        """The day's counter: what the tenant spent today, with what requests in flight reserved."""
        key = self.limiter._neurons_key(who.tenant_id, _today())
        if self.kind == "memory":
            assert isinstance(self.flaky.counters, MemoryCounters)
            return self.flaky.counters._get(key)
        if self.kind == "redis":
            client = aioredis.Redis.from_url(REDIS_URL)
            value = await client.get(key)
            await client.aclose()
            return float(value or 0.0)
        async with self.store.engine.connect() as connection:
            return float(
                await connection.scalar(select(CounterRow.value).where(CounterRow.key == key)) or 0.0
            )

    async def holds(self) -> list[bytes]:
        """The admissions' holds left in Redis (the other counters keep none)."""
        if self.kind != "redis":
            return []
        client = aioredis.Redis.from_url(REDIS_URL)
        keys = [k async for k in client.scan_iter(match=f"{self.prefix}*:held:*")]
        await client.aclose()
        return keys

    async def lose_counters(self) -> None:
        """As a Redis restarted empty does (or the counters' rows deleted)."""
        if self.kind == "memory":
            await self.flaky.counters.close()  # in-process: closing forgets every counter
        elif self.kind == "redis":
            client = aioredis.Redis.from_url(REDIS_URL)
            keys = [k async for k in client.scan_iter(match=f"{self.prefix}*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()
        else:
            async with self.store.engine.begin() as connection:
                await connection.execute(delete(CounterRow).where(CounterRow.key.startswith(self.prefix)))

    async def record(self, who: TenantContext, neurons: float) -> None:
        """What the usage ledger writes about a second after the response."""
        await self.store.add_usage(
            [
                UsageRecord(
                    tenant_id=who.tenant_id, model="@cf/m", request_id=uuid.uuid4().hex, neurons=neurons
                )
            ]
        )


def _today() -> dt.date:
    return dt.datetime.now(dt.UTC).date()


def tenant(daily_neurons: float) -> TenantContext:
    return TenantContext(
        tenant_id=uuid.uuid4().hex,
        name="t",
        plan="paid",
        allowed_models=None,
        token_id=uuid.uuid4().hex,
        quotas=Quotas(daily_neurons=daily_neurons),
    )


async def redis_snapshot(gateway: Gateway) -> dict[bytes, tuple[bytes, int]]:
    """The gateway's keys as a snapshot of the Redis holds them: each one's DUMP and milliseconds
    to live."""
    client = aioredis.Redis.from_url(REDIS_URL)
    snapshot: dict[bytes, tuple[bytes, int]] = {}
    for key in [k async for k in client.scan_iter(match=f"{gateway.prefix}*")]:
        dumped = await client.dump(key)
        assert dumped is not None  # none of them expires within a test
        snapshot[key] = (dumped, await client.pttl(key))
    await client.aclose()
    return snapshot


async def redis_restore(gateway: Gateway, snapshot: dict[bytes, tuple[bytes, int]]) -> None:
    """What a Redis brought back from the snapshot holds: its keys as they were, and none written
    since (the holds of later admissions among them)."""
    client = aioredis.Redis.from_url(REDIS_URL)
    for key in [k async for k in client.scan_iter(match=f"{gateway.prefix}*")]:
        if key not in snapshot:
            await client.delete(key)
    for key, (dumped, ttl_ms) in snapshot.items():
        await client.restore(key, max(ttl_ms, 0), dumped, replace=True)
    await client.aclose()


@pytest.fixture(name="postgres_store", scope="module")
async def postgres_store_fixture(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Store]:
    url, name = await create_database("postgresql", tmp_path_factory.mktemp("db"))
    store = Store()
    await store.open(url)
    try:
        yield store
    finally:
        await store.close()
        await drop_database(name)


@pytest.fixture(name="gateway", params=KINDS)
async def gateway_fixture(
    request: pytest.FixtureRequest, sqlite_store: Store, postgres_store: Store
) -> AsyncIterator[Gateway]:
    kind: str = request.param
    prefix = f"kumo-test-{uuid.uuid4().hex[:10]}:"
    store = postgres_store if kind == "postgresql" else sqlite_store
    counters: Counters = MemoryCounters(time.time)
    if kind == "redis":
        counters = RedisCounters(aioredis.Redis.from_url(REDIS_URL))
    elif kind == "postgresql":
        counters = PostgresCounters(postgres_store, time.time)
    gateway = Gateway(kind, store, prefix, Flaky(counters))
    yield gateway
    await gateway.limiter.close()
    if kind != "memory":
        await gateway.lose_counters()


async def test_a_settle_that_fails_is_retried_until_the_reservation_is_released(gateway: Gateway) -> None:
    """It used to be logged and left: the worst case stayed reserved for the rest of the day, and
    the tenant was refused what it had not spent."""
    limiter, who = gateway.limiter, tenant(daily_neurons=150)
    first = await limiter.admit(who, "@cf/m", 1, worst_neurons=100)
    gateway.flaky.is_down = True
    await limiter.settle(first, tokens=1, neurons=10.0)  # the response is answered all the same
    await asyncio.sleep(RETRY_DELAYS_S[0] + RETRY_DELAYS_S[1] + 0.01)  # two retries fail too
    gateway.flaky.is_down = False
    await limiter.wait_settled()
    assert await gateway.spent(who) == 10.0
    await limiter.admit(who, "@cf/m", 1, worst_neurons=140)  # 10 + 140 fits in 150
    assert gateway.flaky.verdicts == [SETTLED] and limiter.num_settling == 0


async def test_a_retry_after_a_lost_reply_applies_once(gateway: Gateway) -> None:
    """The first retry ran and its reply was lost: the next finds its marker and adds nothing
    (refunded twice, the counter would say 10 - 90 = -80 and hand out 90 neurons never paid for)."""
    limiter, who = gateway.limiter, tenant(daily_neurons=150)
    first = await limiter.admit(who, "@cf/m", 1, worst_neurons=100)
    gateway.flaky.is_down = True
    await limiter.settle(first, tokens=1, neurons=10.0)
    gateway.flaky.is_down, gateway.flaky.num_lost_replies = False, 1
    await limiter.wait_settled()
    assert await gateway.spent(who) == 10.0
    assert gateway.flaky.verdicts == [SETTLED, SETTLED_BEFORE] and await gateway.holds() == []


async def test_a_counter_reseeded_between_admission_and_settle_counts_each_response_once(
    gateway: Gateway,
) -> None:
    """A and B are admitted; A's settle fails and the ledger writes A; the counters are lost and
    C's admission re-seeds them from the ledger (A's 10, C's 20 reserved). A's retry leaves that
    counter alone (it holds A already, and never held A's reservation); B, settled later and not
    in the ledger yet, adds all it cost (5): 10 + 20 + 5. Refunding B's unused 25 there would
    leave 5; counting A again, 45."""
    limiter, flaky, who = gateway.limiter, gateway.flaky, tenant(daily_neurons=1000)
    a = await limiter.admit(who, "@cf/m", 1, worst_neurons=100)
    b = await limiter.admit(who, "@cf/m", 1, worst_neurons=30)
    flaky.are_settles_down = True
    await limiter.settle(a, tokens=1, neurons=10.0)
    await gateway.record(who, 10.0)
    await gateway.lose_counters()  # e.g. Redis restarted empty
    c = await limiter.admit(who, "@cf/m", 1, worst_neurons=20)
    assert c.generation != a.generation
    assert limiter.num_settling == 1, "A's retries ran out before the counters were re-seeded"
    flaky.are_settles_down = False
    await limiter.wait_settled()
    await limiter.settle(b, tokens=1, neurons=5.0)
    assert await gateway.spent(who) == 10.0 + 20.0 + 5.0
    assert flaky.verdicts == [RESEEDED, RESEEDED, SETTLED]  # A's retry; B's refund, then its cost
    if gateway.kind == "redis":  # A's retry and B's settle dropped their holds; C is in flight
        assert await gateway.holds() == [limiter._hold_key(who.tenant_id, c.id).encode()]


@pytest.mark.parametrize("gateway", ["redis"], indirect=True)
async def test_a_counter_restored_from_before_an_admission_is_given_its_whole_cost(gateway: Gateway) -> None:
    """A Redis restored from a snapshot (or a lagging replica promoted) brings the day's counter
    back as it was before A was admitted, under the same generation and without A's hold: A's
    settle adds all it cost, 50 + 10. Refunding A's unused 90 there, as it used to, left
    50 + 10 - 100 = -40: the tenant could spend A's worst case past its allowance.
    B, reserved before the snapshot, still gets its refund (its hold came back with the counter)."""
    limiter, who = gateway.limiter, tenant(daily_neurons=1000)
    await gateway.record(who, 30.0)  # spent earlier today
    b = await limiter.admit(who, "@cf/m", 1, worst_neurons=20)  # seeds the counter: 30 + 20
    snapshot = await redis_snapshot(gateway)
    a = await limiter.admit(who, "@cf/m", 1, worst_neurons=100)
    assert await gateway.spent(who) == 150.0
    await redis_restore(gateway, snapshot)
    assert await gateway.spent(who) == 50.0
    await limiter.settle(a, tokens=1, neurons=10.0)
    assert await gateway.spent(who) == 50.0 + 10.0
    await limiter.settle(b, tokens=1, neurons=5.0)
    assert await gateway.spent(who) == 30.0 + 10.0 + 5.0
    assert gateway.flaky.verdicts == [SETTLED, SETTLED] and await gateway.holds() == []


@pytest.mark.parametrize("gateway", ["redis"], indirect=True)
async def test_holds_last_only_while_an_admission_is_unsettled(gateway: Gateway) -> None:
    """One key per request for the day would fill Redis: a settle deletes its admission's hold, a
    refused admission leaves none, and neither does one that reserves no neurons."""
    limiter, who = gateway.limiter, tenant(daily_neurons=150)
    first = await limiter.admit(who, "@cf/m", 1, worst_neurons=100)
    with pytest.raises(NeuronsExhausted):
        await limiter.admit(who, "@cf/m", 1, worst_neurons=100)  # 100 + 100 does not fit in 150
    free = await limiter.admit(who, "@cf/m", 1, worst_neurons=0)
    assert await gateway.holds() == [limiter._hold_key(who.tenant_id, first.id).encode()]
    await limiter.settle(first, tokens=1, neurons=10.0)
    await limiter.settle(free, tokens=1, neurons=0.0)
    assert await gateway.holds() == [] and await gateway.spent(who) == 10.0


async def test_a_retried_settle_that_finds_no_counter_drops_its_hold(gateway: Gateway) -> None:
    """The day's counter vanished (evicted, deleted by hand) but not the hold, while the settle was
    being retried in the background: the retry ends there (the ledger has the response by then), and
    its hold must not stay for two days."""
    if gateway.kind != "redis":
        pytest.skip("only Redis keeps holds")
    limiter, who = gateway.limiter, tenant(daily_neurons=1000)
    first = await limiter.admit(who, "@cf/m", 1, worst_neurons=100)
    gateway.flaky.are_settles_down = True
    await limiter.settle(first, tokens=1, neurons=10.0)
    client = aioredis.Redis.from_url(REDIS_URL)
    await client.delete(limiter._neurons_key(who.tenant_id, _today()))
    await client.aclose()
    gateway.flaky.are_settles_down = False
    await limiter.wait_settled()
    assert gateway.flaky.verdicts == [NO_COUNTER] and await gateway.holds() == []


async def test_a_counter_lost_while_a_request_runs_is_seeded_and_given_all_it_cost(gateway: Gateway) -> None:
    limiter, who = gateway.limiter, tenant(daily_neurons=1000)
    await gateway.record(who, 7.0)  # spent earlier today
    first = await limiter.admit(who, "@cf/m", 1, worst_neurons=100)
    await gateway.lose_counters()
    await limiter.settle(first, tokens=1, neurons=10.0)
    assert await gateway.spent(who) == 7.0 + 10.0
    assert limiter.num_settling == 0


async def test_a_settle_gives_up_after_its_retries(sqlite_store: Store) -> None:
    """The counters never came back: the worst case stays reserved, as before retries."""
    flaky = Flaky(MemoryCounters(time.time))
    gateway = Gateway("memory", sqlite_store, "kumo-test:", flaky)
    who = tenant(daily_neurons=150)
    first = await gateway.limiter.admit(who, "@cf/m", 1, worst_neurons=100)
    flaky.is_down = True
    await gateway.limiter.settle(first, tokens=1, neurons=10.0)
    assert gateway.limiter.num_settling == 1
    await gateway.limiter.wait_settled()
    assert await gateway.spent(who) == 100.0 and flaky.verdicts == []
    await gateway.limiter.close()


async def test_retries_are_bounded_and_closing_abandons_them(
    sqlite_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quotas, "MAX_SETTLING", 2)
    flaky = Flaky(MemoryCounters(time.time))
    limiter = Limiter(flaky, sqlite_store, settle_retry_delays_s=(3600.0,))
    flaky.is_down = True
    for _ in range(3):
        admission = Admission(tenant_id="t", model="@cf/m", minute=0, estimated_tokens=1)
        await limiter.settle(admission, tokens=1, neurons=1.0)
    assert limiter.num_settling == 2  # the third stays reserved, as without retries
    await limiter.close()
    assert limiter.num_settling == 0
