"""Quotas, in-process and in Redis: exact under concurrency, across two "replicas", with
token true-up, the daily neuron allowance, its reset at 00:00 UTC and its seeding from the ledger."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from tenancy_db import sqlite_store_fixture  # noqa: F401  (fixture)

from gateway.auth import TenantContext
from gateway.errors import NeuronsExhausted, RateLimited, Unavailable, retry_headers
from gateway.quotas import Admission, Limiter, make_limiter
from gateway.store import Store
from schemas.admin import Quotas, UsageRecord

REDIS_URL = "redis://127.0.0.1:6379/0"
NOON = dt.datetime(2026, 5, 4, 12, 0, 10, tzinfo=dt.UTC).timestamp()


class Clock:
    def __init__(self, now: float = NOON) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def tenant(plan: str = "paid", **quotas: float | None) -> TenantContext:
    return TenantContext(
        tenant_id=uuid.uuid4().hex,
        name="t",
        plan=plan,  # type: ignore[arg-type]
        allowed_models=None,
        token_id=uuid.uuid4().hex,
        quotas=Quotas(**quotas),  # type: ignore[arg-type]
    )


async def outcomes(limiter: Limiter, who: TenantContext, n: int, tokens: int = 1) -> list[str]:
    async def one() -> str:
        try:
            await limiter.admit(who, "@cf/m", tokens)
        except RateLimited:
            return "429"
        return "ok"

    return list(await asyncio.gather(*(one() for _ in range(n))))


@pytest.fixture
async def redis_prefix() -> AsyncIterator[str]:
    """A key prefix unique to this test; its keys are deleted afterwards."""
    prefix = f"kumo-test-{uuid.uuid4().hex[:10]}:"
    yield prefix
    client = aioredis.Redis.from_url(REDIS_URL)
    keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


def limiters(kind: str, store: Store, prefix: str, clock: Clock, n: int) -> list[Limiter]:
    """`n` limiters sharing state the way `n` gateway replicas would (memory: one shared limiter)."""
    if kind == "memory":
        one = make_limiter(None, store, prefix=prefix, clock=clock)
        return [one] * n
    return [make_limiter(REDIS_URL, store, prefix=prefix, clock=clock) for _ in range(n)]


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_requests_per_minute_is_exact_under_concurrent_admits(
    kind: str, sqlite_store: Store, redis_prefix: str
) -> None:
    clock = Clock()
    a, b = limiters(kind, sqlite_store, redis_prefix, clock, 2)
    who = tenant(requests_per_minute=25)
    results = await asyncio.gather(outcomes(a, who, 30), outcomes(b, who, 30))
    assert sum(r.count("ok") for r in results) == 25
    with pytest.raises(RateLimited) as caught:
        await b.admit(who, "@cf/m", 1)
    assert (caught.value.status, caught.value.code) == (429, 3021)
    assert caught.value.retry_after == 50  # the window ends at 12:01:00
    assert "request per min" in caught.value.message
    clock.now += 50
    assert (await outcomes(a, who, 3)) == ["ok"] * 3
    for limiter in {a, b}:
        await limiter.close()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_tokens_per_minute_reserve_the_estimate_and_true_up(
    kind: str, sqlite_store: Store, redis_prefix: str
) -> None:
    a, b = limiters(kind, sqlite_store, redis_prefix, Clock(), 2)
    who = tenant(tokens_per_minute=100)
    first = await a.admit(who, "@cf/m", 80)
    with pytest.raises(RateLimited) as caught:
        await b.admit(who, "@cf/m", 30)
    assert "tokens per min" in caught.value.message
    await a.settle(first, tokens=50, neurons=0.0)  # the response used fewer tokens than estimated
    second = await b.admit(who, "@cf/m", 30)
    await b.settle(second, tokens=60, neurons=0.0)  # ...and this one more: 50 + 60 = 110 ≥ 100
    with pytest.raises(RateLimited):
        await a.admit(who, "@cf/m", 1)
    assert sum(r == "ok" for r in await outcomes(a, tenant(tokens_per_minute=100), 40, tokens=7)) == 14
    with pytest.raises(RateLimited) as caught:  # can never fit: no Retry-After that would not help
        await b.admit(tenant(tokens_per_minute=100), "@cf/m", 101)
    assert (
        caught.value.retry_after is None
        and "more than this account's 100 tokens per minute" in caught.value.message
    )
    assert retry_headers(caught.value) == {"x-should-retry": "false"}  # the SDK must not retry it
    for limiter in {a, b}:
        await limiter.close()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_free_plan_daily_neurons_run_out_and_reset_at_midnight_utc(
    kind: str, sqlite_store: Store, redis_prefix: str
) -> None:
    clock = Clock()
    a, b = limiters(kind, sqlite_store, redis_prefix, clock, 2)
    who = tenant("free", daily_neurons=10_000)
    admission = await a.admit(who, "@cf/m", 10)
    await a.settle(admission, tokens=10, neurons=6_000.0)
    admission = await b.admit(who, "@cf/m", 10)  # 6,000 < 10,000: still allowed
    await b.settle(admission, tokens=10, neurons=4_000.5)
    with pytest.raises(NeuronsExhausted) as caught:
        await a.admit(who, "@cf/m", 10)
    assert (caught.value.status, caught.value.code) == (429, 3036)
    assert "daily free allocation of 10,000 neurons" in caught.value.message
    assert caught.value.retry_after == 12 * 3600 - 10  # until 00:00 UTC
    clock.now += 12 * 3600 - 10
    await b.admit(who, "@cf/m", 10)
    unlimited = tenant("paid")
    for _ in range(3):
        await a.settle(await a.admit(unlimited, "@cf/m", 10), tokens=10, neurons=1e9)
    for limiter in {a, b}:
        await limiter.close()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_restarted_gateway_remembers_todays_neurons_from_the_ledger(
    kind: str, sqlite_store: Store, redis_prefix: str
) -> None:
    who = tenant("free", daily_neurons=100)
    now = dt.datetime.now(dt.UTC)
    await sqlite_store.add_usage(
        [UsageRecord(tenant_id=who.tenant_id, model="@cf/m", request_id="r", neurons=100.0, at=now)]
    )
    [fresh] = limiters(kind, sqlite_store, redis_prefix, Clock(now.timestamp()), 1)
    with pytest.raises(NeuronsExhausted):
        await fresh.admit(who, "@cf/m", 1)
    await fresh.close()


async def test_lost_redis_counters_are_reseeded_from_the_ledger(
    sqlite_store: Store, redis_prefix: str
) -> None:
    clock = Clock(dt.datetime.now(dt.UTC).timestamp())
    [limiter] = limiters("redis", sqlite_store, redis_prefix, clock, 1)
    who = tenant("free", daily_neurons=50)
    admission = await limiter.admit(who, "@cf/m", 1)
    await limiter.settle(admission, tokens=1, neurons=60.0)
    at = dt.datetime.fromtimestamp(clock.now, dt.UTC)
    await sqlite_store.add_usage(
        [UsageRecord(tenant_id=who.tenant_id, model="@cf/m", request_id="r", neurons=60.0, at=at)]
    )
    client = aioredis.Redis.from_url(REDIS_URL)
    await client.delete(
        *[k async for k in client.scan_iter(match=f"{redis_prefix}*")]
    )  # e.g. a Redis restart
    await client.aclose()
    with pytest.raises(NeuronsExhausted):
        await limiter.admit(who, "@cf/m", 1)
    await limiter.close()


async def test_cancelled_admits_never_hand_a_reply_to_the_wrong_caller(
    sqlite_store: Store, redis_prefix: str
) -> None:
    """The redis-py cancellation bug behind the ChatGPT leak (reliability §1.1): a call cancelled
    after sending must not leave its reply for the next caller on the pooled connection."""
    [limiter] = limiters("redis", sqlite_store, redis_prefix, Clock(), 1)
    blocked, open_ = tenant(requests_per_minute=0), tenant()
    for delay in (0.0, 0.0001, 0.0005, 0.001, 0.002):
        tasks = [asyncio.create_task(limiter.admit(open_, "@cf/m", 1)) for _ in range(20)]
        await asyncio.sleep(delay)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(10):
            await limiter.admit(open_, "@cf/m", 1)
            with pytest.raises(RateLimited):
                await limiter.admit(blocked, "@cf/m", 1)
    await limiter.close()


async def test_an_unreachable_redis_fails_closed_and_settle_never_raises(sqlite_store: Store) -> None:
    limiter = make_limiter("redis://127.0.0.1:1/0", sqlite_store, prefix="unused:")
    with pytest.raises(Unavailable) as caught:
        await limiter.admit(tenant(), "@cf/m", 1)
    assert caught.value.status == 503
    await limiter.settle(
        Admission(tenant_id=uuid.uuid4().hex, model="@cf/m", minute=0, estimated_tokens=1),
        tokens=5,
        neurons=1.0,
    )
    await limiter.close()


async def test_the_start_tells_an_unreachable_redis(sqlite_store: Store) -> None:
    """`Limiter.check`, asked as the gateway starts (gateway/services.py logs what it says): a Redis
    that does not answer is named; one that does, or counters in the process, are fine."""
    down = make_limiter("redis://127.0.0.1:1/0", sqlite_store, prefix="unused:")
    problem = await down.check()
    assert problem is not None and "Connection" in problem
    await down.close()
    up = make_limiter(REDIS_URL, sqlite_store, prefix="unused:")
    assert await up.check() is None
    await up.close()
    here = make_limiter(None, sqlite_store)
    assert await here.check() is None
    await here.close()


async def test_a_burst_larger_than_the_redis_pool_waits_instead_of_failing(
    sqlite_store: Store, redis_prefix: str
) -> None:
    [limiter] = limiters("redis", sqlite_store, redis_prefix, Clock(), 1)
    results = await outcomes(limiter, tenant(requests_per_minute=450), 600)
    assert results.count("ok") == 450 and results.count("429") == 150
    await limiter.close()
