"""Slots handed out round-robin by tenant: the batch worker's fair share of its concurrency.

A gateway runs the requests of several batch jobs at once, through `capacity` slots. Whoever asks
for a slot waits in its tenant's line; a freed slot goes to the tenant whose turn it is (the
tenants with someone waiting, in the order they started waiting, each going to the back of the
rotation once served). So a tenant that queued a thousand requests gets one slot per round like
one that queued one, and the newcomer's first request waits behind at most one request of each
other tenant.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class FairSlots:
    """`capacity` slots shared round-robin by tenant (asyncio; one event loop)."""

    def __init__(self, capacity: int) -> None:
        assert capacity >= 1
        self.capacity = capacity
        self.num_busy = 0
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {}
        self._turns: deque[str] = deque()  # tenants with someone waiting, next turn first

    @asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[None]:
        """Hold one slot for the body of the `async with`, once it is `tenant`'s turn."""
        await self._acquire(tenant)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, tenant: str) -> None:
        if self.num_busy < self.capacity and not self._turns:
            self.num_busy += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line = self._waiters.setdefault(tenant, deque())
        if not line:
            self._turns.append(tenant)
        line.append(waiter)
        self._grant()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # granted as it was cancelled: pass it on
                self._release()
            else:
                self._forget(tenant, waiter)
            raise

    def _release(self) -> None:
        self.num_busy -= 1
        self._grant()

    def _grant(self) -> None:
        """Hand free slots to the tenants whose turn it is."""
        while self.num_busy < self.capacity and self._turns:
            tenant = self._turns.popleft()
            line = self._waiters[tenant]
            waiter = line.popleft()
            if line:
                self._turns.append(tenant)
            else:
                del self._waiters[tenant]
            self.num_busy += 1
            waiter.set_result(None)

    def _forget(self, tenant: str, waiter: asyncio.Future[None]) -> None:
        line = self._waiters.get(tenant)
        if line is None or waiter not in line:
            return
        line.remove(waiter)
        if not line:
            del self._waiters[tenant]
            self._turns.remove(tenant)
