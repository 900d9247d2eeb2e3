"""Per-tenant quotas: requests and tokens per minute, neurons per UTC day (DESIGN.md §2 step 1).

Windows are fixed: one counter per tenant per wall-clock minute, one per tenant per UTC day.
Admission checks every limit and reserves in one atomic step (a Lua script in Redis, or a step
without an `await` in-process), so N concurrent admits against a limit of L admit exactly
min(N, L) across all replicas that share the Redis: no check-then-increment race
(reliability §3.1). Tokens are reserved from the caller's estimate and trued up by `settle`.

Daily neurons are reserved the same way, at the request's worst case (every choice at its max
tokens, the prompt at its largest; the caller computes it), and `settle` refunds what the response
did not use. So the day's spend never passes the allowance by more than what responses cost above
their worst case, at any concurrency and across gateways: in Redis by the script, on PostgreSQL
without a Redis under a row lock (`PostgresCounters`), in one process by the same no-`await` step.
A request whose worst case does not fit in what is left is refused, not clamped: 429 with code
3036, saying how much it may cost and how much is left (lower `max_tokens`, or retry once requests
in flight have been settled). Clamping `max_tokens` would silently shorten answers that callers
sized on purpose.

Whenever the day's counter does not exist (first request of the day, a restarted gateway, a flushed
Redis) it is seeded from the usage ledger before anything else, so losing counters never hands out
a fresh allowance.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError

from gateway.auth import TenantContext
from gateway.errors import NeuronsExhausted, OverTokenLimit, RateLimited, Unavailable
from gateway.store import Store

MINUTE_TTL = 120
DAY_TTL = 2 * 86_400
UNLIMITED = -1
REDIS_CONNECTIONS = 64
REDIS_WAIT_SECONDS = 5.0

# KEYS: requests, tokens, neurons. ARGV: request limit, token limit, neuron limit, tokens, minute ttl,
# worst-case neurons, day ttl. Returns 0 admitted, 1 requests per minute, 2 tokens per minute, 3 daily
# neurons used up, 4 neurons unseeded, 5 the request's worst case exceeds the neurons left.
RESERVE_LUA = """
if redis.call('EXISTS', KEYS[3]) == 0 then return 4 end
local rpm, tpm, daily, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local worst = tonumber(ARGV[6])
local spent = tonumber(redis.call('GET', KEYS[3]) or '0')
if daily >= 0 and spent >= daily then return 3 end
if daily >= 0 and spent + worst > daily then return 5 end
if rpm >= 0 and tonumber(redis.call('GET', KEYS[1]) or '0') + 1 > rpm then return 1 end
if tpm >= 0 and tonumber(redis.call('GET', KEYS[2]) or '0') + tokens > tpm then return 2 end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('INCRBY', KEYS[2], tokens)
redis.call('EXPIRE', KEYS[2], ARGV[5])
redis.call('INCRBYFLOAT', KEYS[3], worst)
redis.call('EXPIRE', KEYS[3], ARGV[7])
return 0
"""
# KEYS: a counter. ARGV: amount, ttl. Adds only to a counter that exists; returns whether it did.
ADD_EXISTING_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('INCRBYFLOAT', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""
ADMITTED, OVER_REQUESTS, OVER_TOKENS, OVER_NEURONS, UNSEEDED, OVER_NEURONS_LEFT = 0, 1, 2, 3, 4, 5
# what a counter backend (Redis) or the ledger's store raise when they cannot be reached
BACKEND_ERRORS = (RedisError, OSError, SQLAlchemyError)

log = structlog.get_logger("kumo.quotas")


@dataclass(frozen=True)
class Admission:
    """A granted admission: what `settle` needs to true up the reservation."""

    tenant_id: str
    model: str
    minute: int  # unix minute of the window the tokens were reserved in
    estimated_tokens: int
    day: dt.date = dt.date.min  # UTC day the neurons were reserved on
    reserved_neurons: float = 0.0  # the request's worst case, reserved at admission


class Counters(Protocol):
    """Where the windows' counters live: this process, or a Redis shared by replicas."""

    async def reserve(
        self, keys: tuple[str, str, str], limits: tuple[int, int, float], tokens: int, neurons: float
    ) -> int: ...
    async def add(self, key: str, amount: float, ttl: int) -> None: ...
    async def add_existing(self, key: str, amount: float, ttl: int) -> bool: ...
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

    def _exists(self, key: str) -> bool:
        return key in self._values and self._values[key][1] > self._clock()

    def _put(self, key: str, value: float, ttl: int) -> None:
        now = self._clock()
        self._values[key] = (value, now + ttl)
        if now >= self._next_prune:
            self._values = {k: v for k, v in self._values.items() if v[1] > now}
            self._next_prune = now + MINUTE_TTL

    async def reserve(
        self, keys: tuple[str, str, str], limits: tuple[int, int, float], tokens: int, neurons: float
    ) -> int:
        # no `await` in here: the check and the reservation are one step for this process's requests
        (rk, tk, nk), (rpm, tpm, daily) = keys, limits
        if not self._exists(nk):
            return UNSEEDED
        if daily >= 0 and self._get(nk) >= daily:
            return OVER_NEURONS
        if daily >= 0 and self._get(nk) + neurons > daily:
            return OVER_NEURONS_LEFT
        verdict = self.reserve_minute(rk, tk, rpm, tpm, tokens)
        if verdict == ADMITTED:
            self._put(nk, self._get(nk) + neurons, DAY_TTL)
        return verdict

    def reserve_minute(self, rk: str, tk: str, rpm: int, tpm: int, tokens: int) -> int:
        """The per-minute part of `reserve`: one request and `tokens` tokens."""
        if rpm >= 0 and self._get(rk) + 1 > rpm:
            return OVER_REQUESTS
        if tpm >= 0 and self._get(tk) + tokens > tpm:
            return OVER_TOKENS
        self._put(rk, self._get(rk) + 1, MINUTE_TTL)
        self._put(tk, self._get(tk) + tokens, MINUTE_TTL)
        return ADMITTED

    async def add(self, key: str, amount: float, ttl: int) -> None:
        self._put(key, self._get(key) + amount, ttl)

    async def add_existing(self, key: str, amount: float, ttl: int) -> bool:
        if not self._exists(key):
            return False
        self._put(key, self._get(key) + amount, ttl)
        return True

    async def seed(self, key: str, value: float, ttl: int) -> None:
        if not self._exists(key):
            self._put(key, value, ttl)

    async def close(self) -> None:
        self._values.clear()


class RedisCounters:
    """Counters in Redis: one Lua script reserves atomically for every replica sharing it."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._reserve = client.register_script(RESERVE_LUA)
        self._add_existing = client.register_script(ADD_EXISTING_LUA)

    async def reserve(
        self, keys: tuple[str, str, str], limits: tuple[int, int, float], tokens: int, neurons: float
    ) -> int:
        args = [*limits, tokens, MINUTE_TTL, neurons, DAY_TTL]
        return int(await self._reserve(keys=list(keys), args=args))

    async def add(self, key: str, amount: float, ttl: int) -> None:
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.incrbyfloat(key, amount)
            pipe.expire(key, ttl)
            await pipe.execute()

    async def add_existing(self, key: str, amount: float, ttl: int) -> bool:
        return bool(await self._add_existing(keys=[key], args=[amount, ttl]))

    async def seed(self, key: str, value: float, ttl: int) -> None:
        await self._client.set(key, value, nx=True, ex=ttl)

    async def close(self) -> None:
        await self._client.aclose()


class PostgresCounters:
    """Gateways sharing PostgreSQL without a Redis: the day's neurons in the database, reserved
    under a row lock (`gateway.store.counters`), so the budget holds across gateways; the minute
    windows stay in this process (each gateway enforces them alone, as without a database)."""

    def __init__(self, store: Store, clock: Callable[[], float]) -> None:
        self._store = store
        self._minutes = MemoryCounters(clock)

    async def reserve(
        self, keys: tuple[str, str, str], limits: tuple[int, int, float], tokens: int, neurons: float
    ) -> int:
        (rk, tk, nk), (rpm, tpm, daily) = keys, limits
        verdict = self._minutes.reserve_minute(rk, tk, rpm, tpm, tokens)
        if verdict != ADMITTED:
            return verdict
        found = "failed"
        try:
            found = await self._store.reserve_counter(nk, neurons, daily)
        finally:
            if found != "admitted":  # give the minute windows back
                await self._minutes.add(rk, -1, MINUTE_TTL)
                await self._minutes.add(tk, -tokens, MINUTE_TTL)
        return {"exhausted": OVER_NEURONS, "too_big": OVER_NEURONS_LEFT, "unseeded": UNSEEDED}.get(
            found, ADMITTED
        )

    async def add(self, key: str, amount: float, ttl: int) -> None:
        await self._minutes.add(key, amount, ttl)  # only the minute windows are added to blindly

    async def add_existing(self, key: str, amount: float, ttl: int) -> bool:
        return await self._store.add_to_counter(key, amount)

    async def seed(self, key: str, value: float, ttl: int) -> None:
        await self._store.seed_counter(key, value, ttl)

    async def close(self) -> None:
        await self._minutes.close()


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

    def _key(self, tenant_id: str, kind: str, window: str) -> str:
        # `{tenant}` is a Redis Cluster hash tag: one tenant's keys share a slot, so the script may touch them
        return f"{self._prefix}{{{tenant_id}}}:{kind}:{window}"

    def _day(self, now: float) -> dt.date:
        return dt.datetime.fromtimestamp(now, dt.UTC).date()

    def _neurons_key(self, tenant_id: str, day: dt.date) -> str:
        return self._key(tenant_id, "neurons", day.isoformat())

    async def _seed(self, tenant_id: str, day: dt.date) -> None:
        """Start the day's neuron counter from the ledger (a no-op if another replica just did)."""
        spent = await self._store.neurons_on(tenant_id, day)
        await self._counters.seed(self._neurons_key(tenant_id, day), spent, DAY_TTL)

    async def admit(
        self, tenant: TenantContext, model: str, estimated_tokens: int, worst_neurons: float = 0.0
    ) -> Admission:
        """Reserve one request, `estimated_tokens` tokens and `worst_neurons` (the most the request
        can cost), or raise 429 with `retry_after`."""
        now = self._clock()
        minute = int(now // 60)
        q = tenant.quotas
        limits = (
            UNLIMITED if q.requests_per_minute is None else q.requests_per_minute,
            UNLIMITED if q.tokens_per_minute is None else q.tokens_per_minute,
            UNLIMITED if q.daily_neurons is None else q.daily_neurons,
        )
        if 0 <= limits[1] < estimated_tokens:  # could never fit any window: say so rather than "retry later"
            raise OverTokenLimit(
                f"rate limiting: the request may use {estimated_tokens} tokens, more than this account's "
                f"{limits[1]} tokens per minute"
            )
        day = self._day(now)
        keys = (
            self._key(tenant.tenant_id, "requests", str(minute)),
            self._key(tenant.tenant_id, "tokens", str(minute)),
            self._neurons_key(tenant.tenant_id, day),
        )
        try:
            verdict = await self._counters.reserve(keys, limits, estimated_tokens, worst_neurons)
            if verdict == UNSEEDED:
                await self._seed(tenant.tenant_id, day)
                verdict = await self._counters.reserve(keys, limits, estimated_tokens, worst_neurons)
        except BACKEND_ERRORS as exc:  # fail closed: quotas that cannot be checked are not granted
            raise Unavailable("Rate limiter unavailable, please try again.", retry_after=1) from exc
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
        if verdict == UNSEEDED:  # the counter vanished again between seeding and reserving
            raise Unavailable("Rate limiter unavailable, please try again.", retry_after=1)
        if verdict == OVER_NEURONS:
            tomorrow = dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), dt.UTC)
            raise NeuronsExhausted(
                _neurons_message(tenant, limits[2]), retry_after=_seconds_to(tomorrow.timestamp(), now)
            )
        if verdict == OVER_NEURONS_LEFT:  # refused, not clamped (module docstring)
            raise NeuronsExhausted(
                f"This request may cost up to {worst_neurons:,.2f} neurons, more than is left of the daily "
                f"allocation of {limits[2]:,.0f} neurons (requests in flight hold their share until they "
                "finish). Lower max_tokens, or retry later.",
                retry_after=1,
            )
        return Admission(
            tenant_id=tenant.tenant_id,
            model=model,
            minute=minute,
            estimated_tokens=estimated_tokens,
            day=day,
            reserved_neurons=worst_neurons,
        )

    async def settle(self, admission: Admission, *, tokens: int, neurons: float) -> None:
        """True up the token reservation, and the neuron reservation of the admission's day to what
        the response cost (refunding the unused part of its worst case). Never raises for an
        unreachable backend: the response is already served and the ledger still records it."""
        try:
            if tokens != admission.estimated_tokens:
                key = self._key(admission.tenant_id, "tokens", str(admission.minute))
                await self._counters.add(key, tokens - admission.estimated_tokens, MINUTE_TTL)
            if neurons != admission.reserved_neurons:
                key = self._neurons_key(admission.tenant_id, admission.day)
                if not await self._counters.add_existing(key, neurons - admission.reserved_neurons, DAY_TTL):
                    # the counter was lost since admission: seeded from the ledger, it lacks this response
                    await self._seed(admission.tenant_id, admission.day)
                    await self._counters.add_existing(key, neurons, DAY_TTL)
        except BACKEND_ERRORS as exc:
            log.warning("quota settle failed", tenant_id=admission.tenant_id, error=repr(exc))

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
    """Redis-backed counters (shared by replicas) with a Redis URL; without one, the day's neurons
    in the store when it is PostgreSQL (shared by replicas), else everything in this process."""
    counters: Counters
    if redis_url is None and store.engine.dialect.name == "postgresql":
        counters = PostgresCounters(store, clock)
    elif redis_url is None:
        counters = MemoryCounters(clock)
    else:
        # a blocking pool: a burst waits for a free connection instead of failing with "Too many connections"
        pool = aioredis.BlockingConnectionPool.from_url(
            redis_url, max_connections=REDIS_CONNECTIONS, timeout=REDIS_WAIT_SECONDS
        )
        counters = RedisCounters(aioredis.Redis.from_pool(pool))
    return Limiter(counters, store, prefix=prefix, clock=clock)
