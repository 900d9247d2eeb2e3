"""Pools and the router: which replica serves a request (DESIGN §2 step 3).

Each pool is the set of replicas serving one catalog entry. A background loop polls every replica's
`/v1/health`, `/v1/load` and `/v1/model`: failures eject a replica, a later success returns it, and
a replica whose card disagrees with its catalog entry (architecture, vision) is never served. A
request goes to its session's replica by rendezvous hashing when it carries `x-session-affinity`,
else to the least-loaded one; a replica that fails before the first byte is retried on the next.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import tomllib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import anyio
import httpx
import msgspec
import structlog

from gateway import errors
from gateway.backend_client import BackendClient, Dispatch, ReplicaFailed
from gateway.catalog import CatalogError
from schemas.backend import Error, Event, GenerateRequest, LoadReport, ModelCard
from schemas.catalog import ModelSpec, PoolsFile

log = structlog.get_logger("kumo.pools")


@dataclass
class Replica:
    url: str
    is_healthy: bool = False
    num_failures: int = 0
    load: LoadReport | None = None
    card: ModelCard | None = None
    is_mismatched: bool = False
    num_in_flight: int = 0

    @property
    def is_servable(self) -> bool:
        return self.is_healthy and self.card is not None and not self.is_mismatched

    def load_score(self) -> tuple[int, int]:
        """Lower is better: queued + running (+ what we sent since the last report), then fewer free pages."""
        if self.load is None:
            return (self.num_in_flight, 0)
        return (self.load.waiting + self.load.running + self.num_in_flight, -self.load.free_pages)


@dataclass
class Pool:
    name: str
    model: ModelSpec
    replicas: list[Replica] = field(default_factory=list)

    def card(self) -> ModelCard | None:
        return next((r.card for r in self.replicas if r.is_servable), None)

    def mismatch(self, card: ModelCard) -> str | None:
        if card.architecture != self.model.architecture:
            return f"architecture {card.architecture} != catalog {self.model.architecture}"
        if self.model.vision and not card.capabilities.vision:
            return "catalog says vision, backend has none"
        return None


def read_pools_file(text: str) -> PoolsFile:
    """Parse and validate a pools TOML file (`[pools.NAME] replicas = [...], secret = "..."`)."""
    try:
        return msgspec.convert(tomllib.loads(text), PoolsFile)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
        raise CatalogError(f"pools file: {exc}") from exc


class Router:
    """Owns the pools, their health loop, and replica choice. One per app (on `Services`)."""

    def __init__(
        self,
        pools: dict[str, Pool],
        client: BackendClient,
        *,
        health_interval_s: float = 2.0,
        eject_after_failures: int = 2,
        health_timeout_s: float | None = None,
    ) -> None:
        """`health_timeout_s`: the most one replica's check may take before it counts as failed
        (default: five intervals, at least 10 s; each request of it gives up sooner, after
        `backend_client.PROBE_TIMEOUT_S`, closing its connection: a check cut short by this guard,
        a server trickling bytes, leaves its socket to the collector)."""
        self.pools = pools
        self.client = client
        self._interval = health_interval_s
        self._eject_after = eject_after_failures
        self._timeout = health_timeout_s if health_timeout_s is not None else max(10.0, 5 * health_interval_s)
        self._tasks: list[asyncio.Task[None]] = []

    # ---- health --------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.check_all()
        self._tasks = [
            asyncio.create_task(self._loop(pool, replica), name=f"kumo-health {replica.url}")
            for pool in self.pools.values()
            for replica in pool.replicas
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _loop(self, pool: Pool, replica: Replica) -> None:
        """One replica's checks, on its own: a replica that never answers (a stopped process, a
        wedged event loop) once held every other replica's check for the backend read timeout
        (600 s) and was never ejected."""
        while True:
            await asyncio.sleep(self._interval)
            await self._check(pool, replica)

    async def check_all(self) -> None:
        checks = [self._check(pool, r) for pool in self.pools.values() for r in pool.replicas]
        await asyncio.gather(*checks)

    async def _check(self, pool: Pool, replica: Replica) -> None:
        try:
            # anyio's deadline, not asyncio's: a check cut while httpx's pool closes its expired
            # keep-alive connections (a CancelledError inside httpcore's `_close_connections`) left
            # those it had not closed yet out of the pool and open, to warn in whatever test or
            # request the garbage collector next ran in (encode/httpcore#830); httpcore shields that
            # close from anyio's cancellation only
            with anyio.fail_after(self._timeout):
                health = await self.client.health(replica.url)
                replica.load = await self.client.load(replica.url)
                if replica.card is None and health.status == "ok":
                    replica.card = await self.client.model_card(replica.url)
        except TimeoutError:
            self._failed(pool, replica, f"no answer in {self._timeout:g} s", eject_now=False)
            return
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            self._failed(pool, replica, type(exc).__name__, eject_now=False)
            return
        except Exception as exc:  # anything else counts as a failed check: the loop must go on
            log.error("health_check_crashed", pool=pool.name, replica=replica.url, exc_info=exc)
            self._failed(pool, replica, type(exc).__name__, eject_now=False)
            return
        if health.status != "ok" or replica.card is None:
            self._failed(pool, replica, f"status {health.status}", eject_now=True)
            return
        problem = pool.mismatch(replica.card)
        if problem is not None:
            if not replica.is_mismatched:
                log.error("pool_mismatch", pool=pool.name, replica=replica.url, problem=problem)
            replica.is_mismatched = True
        else:
            replica.is_mismatched = False
        if not replica.is_healthy:
            log.info("replica_ready", pool=pool.name, replica=replica.url, model=replica.card.name)
        replica.is_healthy, replica.num_failures = True, 0

    def _failed(self, pool: Pool, replica: Replica, reason: str, *, eject_now: bool) -> None:
        replica.num_failures += 1
        if replica.is_healthy and (eject_now or replica.num_failures >= self._eject_after):
            log.warning("replica_ejected", pool=pool.name, replica=replica.url, reason=reason)
            replica.is_healthy = False
            replica.card = None

    def card(self, pool_name: str) -> ModelCard | None:
        """What a servable replica of the pool reports (its context window, capabilities), or None."""
        pool = self.pools.get(pool_name)
        return pool.card() if pool is not None else None

    # ---- choice --------------------------------------------------------------------------------------
    def pool_for(self, model: ModelSpec) -> Pool:
        pool = self.pools.get(model.pool)
        if pool is None:
            raise errors.Unavailable(f"No capacity for {model.name}")
        return pool

    def candidates(self, pool: Pool, affinity: str | None) -> list[Replica]:
        """Servable replicas in the order to try them."""
        live = [r for r in pool.replicas if r.is_servable]
        if not live:
            raise errors.Unavailable(f"No capacity for {pool.model.name}", retry_after=5)
        if affinity:
            return sorted(live, key=lambda r: _rendezvous(affinity, r.url), reverse=True)
        random.shuffle(live)  # ties broken at random, so equal replicas share the load
        return sorted(live, key=Replica.load_score)

    async def generate(
        self,
        model: ModelSpec,
        request: GenerateRequest,
        *,
        affinity: str | None = None,
        dispatch: Dispatch | None = None,
    ) -> AsyncGenerator[tuple[str, Event], None]:
        """Events of one request, each with the replica url that produced it. Retries on the next
        candidate while nothing has been received; after that, a failure ends the stream with a
        backend `Error` event mapped by the caller. `dispatch` says whether a replica holds the
        request (the one being tried, once it has the whole body)."""
        pool = self.pool_for(model)
        last: errors.KumoError | None = None
        for replica in self.candidates(pool, affinity):
            started = False
            replica.num_in_flight += 1
            try:
                async with self.client.generate(replica.url, request, dispatch) as events:
                    async for event in events:
                        started = True
                        yield replica.url, event
                return
            except ReplicaFailed as exc:
                if started:
                    yield replica.url, Error(code="internal", message="replica failed mid-stream")
                    return
                log.warning("replica_failed", pool=pool.name, replica=replica.url, reason=str(exc))
                if exc.error is None:
                    self._failed(pool, replica, str(exc), eject_now=True)
                last = exc.error or last
            finally:
                replica.num_in_flight -= 1
        raise last or errors.Unavailable(f"No capacity for {model.name}", retry_after=5)


def _rendezvous(key: str, url: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{key}\x00{url}".encode()).digest()[:8], "big")
