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

Settling is exact across lost counters and lost replies. Each day counter has a generation, set when
it is seeded and carried by the admissions reserved on it, and each admission settles at most once
(a marker per admission, so an attempt whose reply was lost after it ran is not applied again). The
refund `neurons - reserved` goes only to the counter of the admission's generation. `settle` runs
before the response's usage goes to the ledger, so a counter of another generation (seeded since
admission) lacks the response: it is given the whole cost. If the counters cannot be reached, the
settlement is tried again in the background for about a minute (`SETTLE_RETRY_DELAYS_S`), the
response already answered; the ledger has the response by then, so a counter seeded since is left
as it is, and a missing one will be seeded with it. After that the worst case stays reserved.
What a re-seed can still miss is a response settled but not yet written by the ledger (it writes
about once a second), or one whose first settle failed on a counter already re-seeded: the ledger
bills it, the new counter does not count it.

A Redis restored from a snapshot, or a replica promoted behind its primary, brings back an older
counter under the same generation, which lacks the reservations made since. So in Redis each
admission also leaves a hold (a key holding its worst case, set by the reservation's script), and
its settlement deletes it: a counter of the admission's generation without the hold never held the
reservation, and is given the whole cost rather than the refund (which could have taken it below
what was spent). What a restored counter still lacks is what was admitted and settled between the
snapshot and the restore (the ledger bills it, the counter does not count it); a hold it brings back
whose settlement ran before the restore keeps that worst case reserved for the day, and so does a hold
evicted before its settlement (the quota Redis is meant to run with `maxmemory-policy noeviction`).
Counters in this process cannot be restored. PostgreSQL keeps no holds (a row written and deleted per
request): a database restored to a point in time, or an asynchronous standby promoted behind its
primary, brings back counters that lack reservations made since, whose refunds can then exceed what
they hold; after such a restore delete the counters' rows (`quota_counters`: they are re-seeded from
the ledger), or run a synchronous standby.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import secrets
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
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
# a failed settlement is tried again after each delay (about a minute in all), never later than
# SETTLE_GIVE_UP_S after the response; its marker outlives that (SETTLED_TTL), so no retry applies twice
SETTLE_RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
SETTLE_GIVE_UP_S = 120.0
SETTLED_TTL = 300
MAX_SETTLING = 10_000  # settlements retried at once: a long outage at a high rate holds no more in memory

# KEYS: requests, tokens, neurons, the neurons' generation, the admission's hold. ARGV: request limit,
# token limit, neuron limit, tokens, minute ttl, worst-case neurons, day ttl. Returns {verdict,
# generation}: 0 admitted (on the counter of that generation; the hold set to the worst case unless it
# is 0), 1 requests per minute, 2 tokens per minute, 3 daily neurons used up, 4 neurons unseeded, 5
# the request's worst case exceeds the neurons left.
RESERVE_LUA = """
if redis.call('EXISTS', KEYS[3]) == 0 then return {4, ''} end
local rpm, tpm, daily, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local worst = tonumber(ARGV[6])
local spent = tonumber(redis.call('GET', KEYS[3]) or '0')
if daily >= 0 and spent >= daily then return {3, ''} end
if daily >= 0 and spent + worst > daily then return {5, ''} end
if rpm >= 0 and tonumber(redis.call('GET', KEYS[1]) or '0') + 1 > rpm then return {1, ''} end
if tpm >= 0 and tonumber(redis.call('GET', KEYS[2]) or '0') + tokens > tpm then return {2, ''} end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('INCRBY', KEYS[2], tokens)
redis.call('EXPIRE', KEYS[2], ARGV[5])
redis.call('INCRBYFLOAT', KEYS[3], worst)
redis.call('EXPIRE', KEYS[3], ARGV[7])
if worst > 0 then redis.call('SET', KEYS[5], ARGV[6], 'EX', ARGV[7]) end
return {0, redis.call('GET', KEYS[4]) or ''}
"""
# KEYS: a counter, its generation. ARGV: value, a new generation, ttl. Creates the counter with that
# generation unless it exists; returns the generation of the counter there now.
SEED_LUA = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[3]) then
  redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
  return ARGV[2]
end
return redis.call('GET', KEYS[2]) or ''
"""
# KEYS: a counter, its generation, a settlement's marker, the admission's hold. ARGV: day ttl, marker
# ttl, the whole cost, then pairs of a generation and the amount to add to a counter of that generation
# while the hold is there; the whole cost is added instead once it is gone (the counter never held the
# reservation). Returns {verdict, the counter's generation}: 0 settled, 1 settled before (the marker is
# there), 2 no counter, 3 a generation not listed (a counter seeded since admission); but for 1, the hold
# goes (a counter seeded after 2 or 3 never held the reservation: it is given the whole cost either way).
SETTLE_LUA = """
if redis.call('EXISTS', KEYS[3]) == 1 then return {1, ''} end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[4])
  return {2, ''}
end
local generation = redis.call('GET', KEYS[2]) or ''
for i = 4, #ARGV, 2 do
  if ARGV[i] == generation then
    local amount = ARGV[i + 1]
    if redis.call('DEL', KEYS[4]) == 0 then amount = ARGV[3] end
    redis.call('INCRBYFLOAT', KEYS[1], amount)
    redis.call('EXPIRE', KEYS[1], ARGV[1])
    redis.call('SET', KEYS[3], '1', 'EX', ARGV[2])
    return {0, generation}
  end
end
redis.call('DEL', KEYS[4])
return {3, generation}
"""
ADMITTED, OVER_REQUESTS, OVER_TOKENS, OVER_NEURONS, UNSEEDED, OVER_NEURONS_LEFT = 0, 1, 2, 3, 4, 5
SETTLED, SETTLED_BEFORE, NO_COUNTER, RESEEDED = 0, 1, 2, 3
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


@dataclass(frozen=True)
class Settlement:
    """A response's neurons to settle on the day's counter, at most once (`marker`): the amount to
    add to a counter of each listed generation while the admission's `hold` is there, else `cost`
    (Redis only: a counter restored from before the admission lacks its reservation and its hold).
    A counter of any other generation is left as it is."""

    key: str
    marker: str
    hold: str
    cost: float  # what the response cost: all of it goes to a counter that never held the reservation
    amounts: Mapping[str, float]  # a counter's generation → the neurons to add to it

    def adding(self, generation: str, amount: float) -> Settlement:
        return replace(self, amounts={**self.amounts, generation: amount})


class Counters(Protocol):
    """Where the windows' counters live: this process, or a Redis shared by replicas."""

    async def reserve(
        self,
        keys: tuple[str, str, str],
        limits: tuple[int, int, float],
        tokens: int,
        neurons: float,
        hold: str,
    ) -> tuple[int, str]: ...  # the verdict, and the generation of the neuron counter reserved on
    async def add(self, key: str, amount: float, ttl: int) -> None: ...
    async def settle(self, settlement: Settlement) -> tuple[int, str]: ...  # the verdict, the generation
    async def seed(self, key: str, value: float, ttl: int) -> str: ...  # the generation of the counter
    async def close(self) -> None: ...


def new_generation() -> str:
    return secrets.token_hex(8)


class MemoryCounters:
    """Counters in this process; expired windows are pruned as time moves on."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._values: dict[str, tuple[float, float]] = {}  # key → (value, expires at)
        self._generations: dict[str, str] = {}  # a day counter's key → its generation, set at seed
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
            self._generations = {k: g for k, g in self._generations.items() if k in self._values}
            self._next_prune = now + MINUTE_TTL

    async def reserve(
        self,
        keys: tuple[str, str, str],
        limits: tuple[int, int, float],
        tokens: int,
        neurons: float,
        hold: str,
    ) -> tuple[int, str]:
        # no `await` in here: the check and the reservation are one step for this process's requests;
        # no hold: counters in this process are never brought back from a snapshot
        (rk, tk, nk), (rpm, tpm, daily) = keys, limits
        if not self._exists(nk):
            return UNSEEDED, ""
        if daily >= 0 and self._get(nk) >= daily:
            return OVER_NEURONS, ""
        if daily >= 0 and self._get(nk) + neurons > daily:
            return OVER_NEURONS_LEFT, ""
        verdict = self.reserve_minute(rk, tk, rpm, tpm, tokens)
        if verdict == ADMITTED:
            self._put(nk, self._get(nk) + neurons, DAY_TTL)
        return verdict, self._generations.get(nk, "")

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

    async def settle(self, settlement: Settlement) -> tuple[int, str]:
        if self._exists(settlement.marker):
            return SETTLED_BEFORE, ""
        if not self._exists(settlement.key):
            return NO_COUNTER, ""
        generation = self._generations.get(settlement.key, "")
        if generation not in settlement.amounts:
            return RESEEDED, generation
        self._put(settlement.key, self._get(settlement.key) + settlement.amounts[generation], DAY_TTL)
        self._put(settlement.marker, 1.0, SETTLED_TTL)
        return SETTLED, generation

    async def seed(self, key: str, value: float, ttl: int) -> str:
        if not self._exists(key):
            self._put(key, value, ttl)
            self._generations[key] = new_generation()
        return self._generations[key]

    async def close(self) -> None:
        self._values.clear()
        self._generations.clear()


class RedisCounters:
    """Counters in Redis: one Lua script reserves atomically for every replica sharing it, another
    settles; a day counter's generation is kept beside it (`<counter>:generation`)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._reserve = client.register_script(RESERVE_LUA)
        self._seed = client.register_script(SEED_LUA)
        self._settle = client.register_script(SETTLE_LUA)

    async def reserve(
        self,
        keys: tuple[str, str, str],
        limits: tuple[int, int, float],
        tokens: int,
        neurons: float,
        hold: str,
    ) -> tuple[int, str]:
        args = [*limits, tokens, MINUTE_TTL, neurons, DAY_TTL]
        verdict, generation = await self._reserve(keys=[*keys, _generation_key(keys[2]), hold], args=args)
        return int(verdict), _text(generation)

    async def add(self, key: str, amount: float, ttl: int) -> None:
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.incrbyfloat(key, amount)
            pipe.expire(key, ttl)
            await pipe.execute()

    async def settle(self, settlement: Settlement) -> tuple[int, str]:
        keys = [settlement.key, _generation_key(settlement.key), settlement.marker, settlement.hold]
        pairs = [part for generation, amount in settlement.amounts.items() for part in (generation, amount)]
        args = [DAY_TTL, SETTLED_TTL, settlement.cost, *pairs]
        verdict, generation = await self._settle(keys=keys, args=args)
        return int(verdict), _text(generation)

    async def seed(self, key: str, value: float, ttl: int) -> str:
        return _text(await self._seed(keys=[key, _generation_key(key)], args=[value, new_generation(), ttl]))

    async def ping(self) -> None:
        await self._client.ping()

    async def close(self) -> None:
        await self._client.aclose()


def _generation_key(counter_key: str) -> str:
    return f"{counter_key}:generation"


def _text(reply: bytes | str) -> str:
    return reply.decode() if isinstance(reply, bytes) else reply


class PostgresCounters:
    """Gateways sharing PostgreSQL without a Redis: the day's neurons in the database, reserved
    under a row lock (`gateway.store.counters`), so the budget holds across gateways; the minute
    windows stay in this process (each gateway enforces them alone, as without a database)."""

    def __init__(self, store: Store, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock
        self._minutes = MemoryCounters(clock)
        self._next_sweep = 0.0  # settlements' markers are rows too: expired ones are deleted now and then

    async def reserve(
        self,
        keys: tuple[str, str, str],
        limits: tuple[int, int, float],
        tokens: int,
        neurons: float,
        hold: str,
    ) -> tuple[int, str]:
        # no hold (a row written and deleted per request): a database restored behind its last
        # reservations is not covered (the module docstring says what to do then)
        (rk, tk, nk), (rpm, tpm, daily) = keys, limits
        verdict = self._minutes.reserve_minute(rk, tk, rpm, tpm, tokens)
        if verdict != ADMITTED:
            return verdict, ""
        found, generation = "failed", ""
        try:
            found, generation = await self._store.reserve_counter(nk, neurons, daily)
        finally:
            if found != "admitted":  # give the minute windows back
                await self._minutes.add(rk, -1, MINUTE_TTL)
                await self._minutes.add(tk, -tokens, MINUTE_TTL)
        verdicts = {"exhausted": OVER_NEURONS, "too_big": OVER_NEURONS_LEFT, "unseeded": UNSEEDED}
        return verdicts.get(found, ADMITTED), generation

    async def add(self, key: str, amount: float, ttl: int) -> None:
        await self._minutes.add(key, amount, ttl)  # only the minute windows are added to blindly

    async def settle(self, settlement: Settlement) -> tuple[int, str]:
        found, generation = await self._store.settle_counter(
            settlement.key, settlement.marker, settlement.amounts, SETTLED_TTL
        )
        if found == "settled" and self._clock() >= self._next_sweep:  # failing, retried as settled before
            await self._store.sweep_counters()
            self._next_sweep = self._clock() + SETTLED_TTL
        verdicts = {"settled_before": SETTLED_BEFORE, "no_counter": NO_COUNTER, "reseeded": RESEEDED}
        return verdicts.get(found, SETTLED), generation

    async def seed(self, key: str, value: float, ttl: int) -> str:
        return await self._store.seed_counter(key, value, ttl, new_generation())

    async def close(self) -> None:
        await self._minutes.close()


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
