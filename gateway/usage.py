"""The usage ledger (DESIGN.md §2 step 8) and neuron pricing (reference §8).

`UsageLedger.record` only appends to a list: the response never waits on the database. A
background task writes the list in batches every `flush_seconds` (or as soon as a batch is
full), so the admin API's usage view is at most about that far behind. A failed write keeps its
records for the next attempt (up to `max_pending` of them); `stop()` writes whatever is left.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import structlog

from gateway.store import Store
from schemas.admin import UsageRecord
from schemas.catalog import Price

__all__ = ["UsageLedger", "UsageRecord", "neurons", "NEURONS_PER_USD"]

NEURONS_PER_USD = 1000 / 0.011  # $0.011 per 1,000 neurons
INPUT, OUTPUT, CACHED = "per M input tokens", "per M output tokens", "per M cached input tokens"

log = structlog.get_logger("kumo.usage")


def neurons(price: Sequence[Price], prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
    """Neurons for one response from the catalog's USD price list.

    `prompt_tokens` includes `cached_tokens` (as in `usage`); cached ones are billed at the cached
    price, or at the input price when the model has none. A unit the model does not list is free.
    """
    usd = {p.unit: p.price for p in price if p.currency == "USD"}
    per_input = usd.get(INPUT, 0.0)
    per_cached = usd.get(CACHED, per_input)
    dollars = (
        (prompt_tokens - cached_tokens) * per_input
        + cached_tokens * per_cached
        + completion_tokens * usd.get(OUTPUT, 0.0)
    ) / 1e6
    return dollars * NEURONS_PER_USD


class UsageLedger:
    """Buffers usage records and writes them to the store in the background."""

    def __init__(
        self, store: Store, *, flush_seconds: float = 1.0, max_batch: int = 500, max_pending: int = 200_000
    ) -> None:
        self._store = store
        self._flush_seconds = flush_seconds
        self._max_batch = max_batch
        self._max_pending = max_pending
        self._pending: list[UsageRecord] = []
        self.num_dropped = 0  # records given up during a long database outage (memory is bounded)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._is_stopping = False
        self._writing = asyncio.Lock()  # one flush at a time: see `flush`

    def record(self, record: UsageRecord) -> None:
        """Queue one record; returns at once. Past `max_pending` queued records (the database has
        been away for long) the oldest is dropped and counted, rather than growing without bound."""
        self._pending.append(record)
        if len(self._pending) > self._max_pending:
            del self._pending[0]
            self.num_dropped += 1
            if self.num_dropped % 1000 == 1:
                log.error("usage ledger full; dropping the oldest records", dropped=self.num_dropped)
        if len(self._pending) >= self._max_batch:
            self._wake.set()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="usage-ledger")

    async def stop(self) -> None:
        """Stop the background task and write what is left."""
        # not cancelled: a batch cut off mid-write could be written twice by the retry
        self._is_stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        await self.flush()
        self._is_stopping = False

    async def flush(self) -> None:
        """Write every queued record now, in batches; records of a failed batch stay queued.

        On return, every record queued before the call is in the store (or queued again after a
        failed write): a batch the background task has in flight is waited for, not skipped as
        already taken, so usage read right after a flush is never short.
        """
        async with self._writing:
            while self._pending:
                batch, self._pending = self._pending[: self._max_batch], self._pending[self._max_batch :]
                try:
                    await self._store.add_usage(batch)
                except Exception as exc:
                    self._pending[:0] = batch
                    log.error("usage flush failed; will retry", error=repr(exc), pending=len(self._pending))
                    return

    async def _run(self) -> None:
        while not self._is_stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._flush_seconds)
            self._wake.clear()
            await self.flush()
