"""Per-tenant quotas: requests and tokens per minute, neurons per UTC day (DESIGN.md §2 step 1).

Windows are fixed: one counter per tenant per wall-clock minute, one per tenant per UTC day.
Admission checks every limit and reserves in one atomic step (a Lua script in Redis, or a step
without an `await` in-process), so N concurrent admits against a limit of L admit exactly
min(N, L) across all replicas that share the Redis: no check-then-increment race
(reliability §3.1). Tokens are reserved from the caller's estimate and trued up by `settle`;
neurons are known only after the response, so a tenant is refused once the day's total has
reached its allowance. The day's counter is seeded from the usage ledger the first time a
replica sees the tenant that day, so a restart does not hand out a fresh allowance.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from gateway.auth import TenantContext
from gateway.errors import NeuronsExhausted, RateLimited
from gateway.store import Store

MINUTE_TTL = 120
DAY_TTL = 2 * 86_400
UNLIMITED = -1

# KEYS: requests, tokens, neurons. ARGV: request limit, token limit, neuron limit, tokens, minute ttl.
# Returns 0 admitted, 1 requests per minute, 2 tokens per minute, 3 daily neurons.
RESERVE_LUA = """
local rpm, tpm, daily, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if daily >= 0 and tonumber(redis.call('GET', KEYS[3]) or '0') >= daily then return 3 end
if rpm >= 0 and tonumber(redis.call('GET', KEYS[1]) or '0') + 1 > rpm then return 1 end
if tpm >= 0 and tonumber(redis.call('GET', KEYS[2]) or '0') + tokens > tpm then return 2 end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('INCRBY', KEYS[2], tokens)
redis.call('EXPIRE', KEYS[2], ARGV[5])
return 0
"""
ADMITTED, OVER_REQUESTS, OVER_TOKENS, OVER_NEURONS = 0, 1, 2, 3


@dataclass(frozen=True)
class Admission:
    """A granted admission: what `settle` needs to true up the reservation."""

    tenant_id: str
    model: str
    minute: int  # unix minute of the window the tokens were reserved in
    estimated_tokens: int


class Counters(Protocol):
    """Where the windows' counters live: this process, or a Redis shared by replicas."""

    async def reserve(
        self, keys: tuple[str, str, str], limits: tuple[int, int, float], tokens: int
    ) -> int: ...
    async def add(self, key: str, amount: float, ttl: int) -> None: ...
    async def seed(self, key: str, value: float, ttl: int) -> None: ...
    async def close(self) -> None: ...


class MemoryCounters:
    """Counters in this process; expired windows are pruned as time moves on."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._values: dict[str, tuple[float, float]] = {}  # key → (value, expires at)
        self._next_prune = 0.0

    def _get(self, key: str) -> float:
        value, expires_at = self._values.get(key, (0.0, 0.0))
        return value if expires_at > self._clock() else 0.0

    def _put(self, key: str, value: float, ttl: int) -> None:
        now = self._clock()
        self._values[key] = (value, now + ttl)
        if now >= self._next_prune:
            self._values = {k: v for k, v in self._values.items() if v[1] > now}
            self._next_prune = now + MINUTE_TTL

    async def reserve(self, keys: tuple[str, str, str], limits: tuple[int, int, float], tokens: int) -> int:
        (rk, tk, nk), (rpm, tpm, daily) = keys, limits
        if daily >= 0 and self._get(nk) >= daily:
            return OVER_NEURONS
        if rpm >= 0 and self._get(rk) + 1 > rpm:
            return OVER_REQUESTS
        if tpm >= 0 and self._get(tk) + tokens > tpm:
            return OVER_TOKENS
        self._put(rk, self._get(rk) + 1, MINUTE_TTL)
        self._put(tk, self._get(tk) + tokens, MINUTE_TTL)
        return ADMITTED

    async def add(self, key: str, amount: float, ttl: int) -> None:
        self._put(key, self._get(key) + amount, ttl)

    async def seed(self, key: str, value: float, ttl: int) -> None:
        if key not in self._values or self._values[key][1] <= self._clock():
            self._put(key, value, ttl)

    async def close(self) -> None:
        self._values.clear()


class RedisCounters:
    """Counters in Redis: one Lua script reserves atomically for every replica sharing it."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._reserve = client.register_script(RESERVE_LUA)

    async def reserve(self, keys: tuple[str, str, str], limits: tuple[int, int, float], tokens: int) -> int:
        return int(await self._reserve(keys=list(keys), args=[*limits, tokens, MINUTE_TTL]))

    async def add(self, key: str, amount: float, ttl: int) -> None:
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.incrbyfloat(key, amount)
            pipe.expire(key, ttl)
            await pipe.execute()

    async def seed(self, key: str, value: float, ttl: int) -> None:
        await self._client.set(key, value, nx=True, ex=ttl)

    async def close(self) -> None:
        await self._client.aclose()


class Limiter:
    """Admits requests against the tenant's quotas (carried by its `TenantContext`)."""

    def __init__(
        self,
        counters: Counters,
        store: Store,
        *,
        prefix: str = "kumo:quota:",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._counters = counters
        self._store = store
        self._prefix = prefix
        self._clock = clock
        self._seeded: set[tuple[str, str]] = set()  # (tenant, day) whose neuron counter is seeded here

    def _key(self, tenant_id: str, kind: str, window: str) -> str:
        # `{tenant}` is a Redis Cluster hash tag: one tenant's keys share a slot, so the script may touch them
        return f"{self._prefix}{{{tenant_id}}}:{kind}:{window}"

    def _day(self, now: float) -> dt.date:
        return dt.datetime.fromtimestamp(now, dt.UTC).date()

    async def _neurons_key(self, tenant_id: str, now: float) -> str:
        day = self._day(now)
        key = self._key(tenant_id, "neurons", day.isoformat())
        if (tenant_id, day.isoformat()) not in self._seeded:
            await self._counters.seed(key, await self._store.neurons_on(tenant_id, day), DAY_TTL)
            self._seeded = {s for s in self._seeded if s[1] == day.isoformat()} | {
                (tenant_id, day.isoformat())
            }
        return key

    async def admit(self, tenant: TenantContext, model: str, estimated_tokens: int) -> Admission:
        """Reserve one request and `estimated_tokens` tokens, or raise 429 with `retry_after`."""
        now = self._clock()
        minute = int(now // 60)
        q = tenant.quotas
        keys = (
            self._key(tenant.tenant_id, "requests", str(minute)),
            self._key(tenant.tenant_id, "tokens", str(minute)),
            await self._neurons_key(tenant.tenant_id, now),
        )
        limits = (
            UNLIMITED if q.requests_per_minute is None else q.requests_per_minute,
            UNLIMITED if q.tokens_per_minute is None else q.tokens_per_minute,
            UNLIMITED if q.daily_neurons is None else q.daily_neurons,
        )
        verdict = await self._counters.reserve(keys, limits, estimated_tokens)
        if verdict == OVER_REQUESTS:
            raise RateLimited(
                "rate limiting: inference request per min rate reached",
                retry_after=_seconds_to(60 * (minute + 1), now),
            )
        if verdict == OVER_TOKENS:
            raise RateLimited(
                "rate limiting: inference tokens per min rate reached",
                retry_after=_seconds_to(60 * (minute + 1), now),
            )
        if verdict == OVER_NEURONS:
            tomorrow = dt.datetime.combine(self._day(now) + dt.timedelta(days=1), dt.time(), dt.UTC)
            raise NeuronsExhausted(
                _neurons_message(tenant, limits[2]), retry_after=_seconds_to(tomorrow.timestamp(), now)
            )
        return Admission(
            tenant_id=tenant.tenant_id, model=model, minute=minute, estimated_tokens=estimated_tokens
        )

    async def settle(self, admission: Admission, *, tokens: int, neurons: float) -> None:
        """True up the token reservation and add the response's neurons to today's total."""
        now = self._clock()
        if tokens != admission.estimated_tokens:
            key = self._key(admission.tenant_id, "tokens", str(admission.minute))
            await self._counters.add(key, tokens - admission.estimated_tokens, MINUTE_TTL)
        if neurons:
            await self._counters.add(await self._neurons_key(admission.tenant_id, now), neurons, DAY_TTL)

    async def close(self) -> None:
        await self._counters.close()


def _seconds_to(deadline: float, now: float) -> int:
    return max(1, math.ceil(deadline - now))


def _neurons_message(tenant: TenantContext, allowance: float) -> str:
    if tenant.plan == "free":
        return (
            f"You have used up your daily free allocation of {allowance:,.0f} neurons. Please upgrade to "
            "Cloudflare's Workers Paid plan if you would like to continue usage."
        )
    return f"You have used up your daily allocation of {allowance:,.0f} neurons."


def make_limiter(
    redis_url: str | None,
    store: Store,
    *,
    prefix: str = "kumo:quota:",
    clock: Callable[[], float] = time.time,
) -> Limiter:
    """In-process counters without a Redis URL; Redis-backed (shared by replicas) with one."""
    counters: Counters
    if redis_url is None:
        counters = MemoryCounters(clock)
    else:
        counters = RedisCounters(aioredis.Redis.from_url(redis_url))
    return Limiter(counters, store, prefix=prefix, clock=clock)
