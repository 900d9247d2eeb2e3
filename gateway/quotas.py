"""Per-tenant quotas: requests and tokens per minute, neurons per UTC day (DESIGN.md §2 step 1).

Windows are fixed: one counter per tenant per wall-clock minute, one per tenant per UTC day (they
live in `gateway.quota_counters`). Admission checks every limit and reserves in one atomic step (a
Lua script in Redis, or a step without an `await` in-process), so N concurrent admits against a
limit of L admit exactly min(N, L) across all replicas that share the Redis: no check-then-increment
race (reliability §3.1). Tokens are reserved from the caller's estimate and trued up by `settle`.

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

Settling is exact across lost counters and lost replies: each admission settles at most once, and
its refund `neurons - reserved` goes only to the counter of the generation it was reserved on
(`gateway.quota_counters` says how: generations, markers and, in Redis, holds). `settle` runs
before the response's usage goes to the ledger, so a counter of another generation (seeded since
admission) lacks the response: it is given the whole cost. If the counters cannot be reached, the
settlement is tried again in the background for about a minute (`SETTLE_RETRY_DELAYS_S`), the
response already answered; the ledger has the response by then, so a counter seeded since is left
as it is, and a missing one will be seeded with it. After that the worst case stays reserved.
What a re-seed can still miss is a response settled but not yet written by the ledger (it writes
about once a second), or one whose first settle failed on a counter already re-seeded: the ledger
bills it, the new counter does not count it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError

from gateway.auth import TenantContext
from gateway.errors import NeuronsExhausted, OverTokenLimit, RateLimited, Unavailable
from gateway.quota_counters import (
    DAY_TTL,
    MINUTE_TTL,
    NO_COUNTER,
    OVER_NEURONS,
    OVER_NEURONS_LEFT,
    OVER_REQUESTS,
    OVER_TOKENS,
    SETTLED,
    SETTLED_BEFORE,
    UNLIMITED,
    UNSEEDED,
    Counters,
    MemoryCounters,
    PostgresCounters,
    RedisCounters,
    Settlement,
)
from gateway.store import Store

REDIS_CONNECTIONS = 64
REDIS_WAIT_SECONDS = 5.0
# a failed settlement is tried again after each delay (about a minute in all), never later than
# SETTLE_GIVE_UP_S after the response; its marker outlives that (`quota_counters.SETTLED_TTL`), so no
# retry applies twice
SETTLE_RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
SETTLE_GIVE_UP_S = 120.0
MAX_SETTLING = 10_000  # settlements retried at once: a long outage at a high rate holds no more in memory

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
    generation: str = ""  # of the day's counter the neurons were reserved on
    id: str = field(default_factory=lambda: uuid.uuid4().hex)  # names its hold and its settlement's marker


class Limiter:
    """Admits requests against the tenant's quotas (carried by its `TenantContext`)."""

    async def check(self, timeout_s: float = 2.0) -> str | None:
        """Why the counters cannot be reached now (None: they can, or they live in this process or
        the store, which the start has opened): a gateway whose Redis is down answers every
        request 503/3040, so its start says so rather than announcing itself ready in silence."""
        ping = getattr(self._counters, "ping", None)
        if ping is None:
            return None
        try:
            async with asyncio.timeout(timeout_s):
                await ping()
        except (*BACKEND_ERRORS, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def __init__(
        self,
        counters: Counters,
        store: Store,
        *,
        prefix: str = "kumo:quota:",
        clock: Callable[[], float] = time.time,
        settle_retry_delays_s: Sequence[float] = SETTLE_RETRY_DELAYS_S,
    ) -> None:
        self._counters = counters
        self._store = store
        self._prefix = prefix
        self._clock = clock
        self._settle_retry_delays_s = settle_retry_delays_s
        self._settling: set[asyncio.Task[None]] = set()  # settlements being tried again (`_settle_later`)

    def _key(self, tenant_id: str, kind: str, window: str) -> str:
        # `{tenant}` is a Redis Cluster hash tag: one tenant's keys share a slot, so the script may touch them
        return f"{self._prefix}{{{tenant_id}}}:{kind}:{window}"

    def _day(self, now: float) -> dt.date:
        return dt.datetime.fromtimestamp(now, dt.UTC).date()

    def _neurons_key(self, tenant_id: str, day: dt.date) -> str:
        return self._key(tenant_id, "neurons", day.isoformat())

    def _hold_key(self, tenant_id: str, admission_id: str) -> str:
        return self._key(tenant_id, "held", admission_id)

    async def _seed(self, tenant_id: str, day: dt.date) -> str:
        """Start the day's neuron counter from the ledger (a no-op if another replica just did);
        returns the generation of the counter there now."""
        spent = await self._store.neurons_on(tenant_id, day)
        return await self._counters.seed(self._neurons_key(tenant_id, day), spent, DAY_TTL)

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
        admission_id = uuid.uuid4().hex
        hold = self._hold_key(tenant.tenant_id, admission_id)
        try:
            verdict, generation = await self._counters.reserve(
                keys, limits, estimated_tokens, worst_neurons, hold
            )
            if verdict == UNSEEDED:
                await self._seed(tenant.tenant_id, day)
                verdict, generation = await self._counters.reserve(
                    keys, limits, estimated_tokens, worst_neurons, hold
                )
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
            generation=generation,
            id=admission_id,
        )

    async def settle(self, admission: Admission, *, tokens: int, neurons: float) -> None:
        """True up the token reservation, and the neuron reservation of the admission's day to what
        the response cost (refunding the unused part of its worst case), at most once. Call it before
        the response's usage goes to the ledger: a day counter seeded since admission then lacks the
        response. Never raises for an unreachable backend: the response is already served and the
        ledger still records it; the neurons are settled again in the background (`_settle_later`)."""
        if tokens != admission.estimated_tokens:
            try:
                key = self._key(admission.tenant_id, "tokens", str(admission.minute))
                await self._counters.add(key, tokens - admission.estimated_tokens, MINUTE_TTL)
            except BACKEND_ERRORS as exc:  # a minute's window: not worth trying again
                log.warning("quota settle failed", tenant_id=admission.tenant_id, error=repr(exc))
        if neurons == 0 and admission.reserved_neurons == 0:
            return
        settlement = Settlement(
            key=self._neurons_key(admission.tenant_id, admission.day),
            marker=self._key(admission.tenant_id, "settled", admission.id),
            hold=self._hold_key(admission.tenant_id, admission.id),
            cost=neurons,
            amounts={admission.generation: neurons - admission.reserved_neurons},
        )
        for _ in range(3):  # more only if the day's counter keeps vanishing as it is seeded
            try:
                verdict, generation = await self._counters.settle(settlement)
                if verdict == NO_COUNTER:
                    generation = await self._seed(admission.tenant_id, admission.day)
            except BACKEND_ERRORS as exc:
                log.warning("quota settle failed; retrying", tenant_id=admission.tenant_id, error=repr(exc))
                if len(self._settling) >= MAX_SETTLING:
                    log.error("quota settle not retried: too many retrying", tenant_id=admission.tenant_id)
                    return
                task = asyncio.create_task(self._settle_later(admission.tenant_id, settlement))
                self._settling.add(task)
                task.add_done_callback(self._forget)
                return
            if verdict in (SETTLED, SETTLED_BEFORE):
                return
            # a counter seeded since admission, by this call or another: the ledger does not have
            # this response yet, so that counter lacks all of it (none of its reservation either)
            settlement = settlement.adding(generation, neurons)
        log.warning("quota settle gave up: the day's counter keeps vanishing", tenant_id=admission.tenant_id)

    async def _settle_later(self, tenant_id: str, settlement: Settlement) -> None:
        """Try a settlement again after each of the retry delays until the counters answer. The
        ledger has the response by now (or within one of its writes), so whatever they answer ends
        it: settled now or before, or a counter seeded since (left as it is: it holds the response)
        or none (to be seeded with it)."""
        give_up_at = time.monotonic() + SETTLE_GIVE_UP_S
        for attempt, delay in enumerate(self._settle_retry_delays_s, start=1):
            await asyncio.sleep(delay)
            if time.monotonic() > give_up_at:
                break
            try:
                await self._counters.settle(settlement)
            except BACKEND_ERRORS as exc:
                log.warning(
                    "quota settle failed again", tenant_id=tenant_id, attempt=attempt, error=repr(exc)
                )
                continue
            log.info("quota settled on a retry", tenant_id=tenant_id, attempt=attempt)
            return
        log.error("quota settle given up: its worst case stays reserved for the day", tenant_id=tenant_id)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._settling.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("quota settle failed", exc_info=exc)

    @property
    def num_settling(self) -> int:
        """Settlements being tried again in the background."""
        return len(self._settling)

    async def wait_settled(self) -> None:
        """Wait until the settlements being tried again have ended (settled, or given up)."""
        while self._settling:
            await asyncio.wait(set(self._settling))

    async def close(self) -> None:
        """Stop the settlements still being tried again (their worst cases stay reserved), then the
        counters."""
        if self._settling:
            log.warning("quota settlements abandoned", count=len(self._settling))
            tasks = set(self._settling)
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
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
