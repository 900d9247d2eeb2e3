"""The counters of the quota windows (`gateway.quotas`): in this process (`MemoryCounters`), in a
Redis shared by replicas (`RedisCounters`, whose Lua scripts each run as one atomic step), or, for
the day's neurons of gateways sharing PostgreSQL without a Redis, in the database under a row lock
(`PostgresCounters`). A negative limit (`UNLIMITED`) is not checked.

Each day counter has a generation, set when it is seeded and carried by the admissions reserved on
it, and each admission settles at most once (a marker per admission, so an attempt whose reply was
lost after it ran is not applied again). A settlement adds only to a counter of a generation it
lists (the admission's, with the refund `neurons - reserved`); a counter of another generation
(seeded since admission) is left as it is and its generation returned, for the limiter to decide.

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

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import redis.asyncio as aioredis

from gateway.store import Store

MINUTE_TTL = 120
DAY_TTL = 2 * 86_400
UNLIMITED = -1  # a limit the counters do not check
SETTLED_TTL = 300  # a settlement's marker: outlives its retries (`gateway.quotas.SETTLE_GIVE_UP_S`)

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
