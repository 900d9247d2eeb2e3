"""The async batch queue in the store, shared by every gateway on the same database.

A job is taken by exactly one gateway: `claim` picks the oldest queued job (or a running one
whose lease has expired, because its gateway died) with `SELECT … FOR UPDATE SKIP LOCKED` on
PostgreSQL, then takes it with a compare-and-set `UPDATE … WHERE status/lease still as seen`, which
is also what makes it atomic on SQLite (one writer at a time). The holder renews its lease while
it works; `finish` only lands while the lease is still its own, so a gateway that lost its job
(paused past the lease) cannot overwrite the result of the one that took it over.

A running job's answered requests are kept a row each (`batch_answers`): each renewal, and the
hand-back, adds those answered since the one before, in the same transaction as (and only with) the
lease it holds; `claim` hands them to the next holder, and `finish` deletes them. During a rolling
upgrade from revision 0005, gateways of the release before keep a job's answers in its `progress`
column instead (the whole list, rewritten each renewal): `claim` reads those too.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from gateway.store.rows import now
from gateway.store.tables import BatchAnswerRow, BatchJobRow, TenantRow

QUEUED, RUNNING, DONE = "queued", "running", "done"


@dataclass(frozen=True)
class Refused:
    """Why `submit` queued nothing: the tenant's unfinished jobs are at `max_pending`
    ("pending"), or the bytes its kept jobs hold (requests and results) are at `max_stored_bytes`
    ("stored", with the bytes kept)."""

    reason: str
    stored_bytes: int = 0
    next_expiry: dt.datetime | None = None  # "stored": when the tenant's first kept result expires


def _is_job_id(value: str) -> bool:
    """Whether `value` is a job id as `submit` writes them (a canonical UUID string)."""
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False


@dataclass(frozen=True)
class KeptAnswer:
    """One request of a running job answered for good, as kept in the store."""

    index: int
    item: bytes  # the `schemas.batch.BatchItem`, JSON
    prompt_tokens: int
    completion_tokens: int


class _LegacyAnswer(msgspec.Struct):
    """One entry of revision 0005's `progress` list, as gateways before 0006 write it."""

    index: int
    item: msgspec.Raw
    prompt_tokens: int
    completion_tokens: int


_legacy = msgspec.json.Decoder(list[_LegacyAnswer])


def _legacy_answers(progress: bytes | None, num_requests: int) -> list[KeptAnswer]:
    """The answers a gateway before revision 0006 kept in `progress` (an unreadable list: none, its
    requests run again, as such a gateway treated it)."""
    if not progress:
        return []
    try:
        entries = _legacy.decode(progress)
    except msgspec.DecodeError:
        return []
    return [
        KeptAnswer(a.index, bytes(a.item), a.prompt_tokens, a.completion_tokens)
        for a in entries
        if 0 <= a.index < num_requests
    ]


@dataclass(frozen=True)
class BatchJob:
    id: str
    tenant_id: str
    model: str
    status: str
    num_requests: int
    attempts: int
    requests: bytes | None = None  # only on a claimed job
    responses: bytes | None = None  # only on a finished job
    answers: tuple[KeptAnswer, ...] = ()  # only on a claimed job: those earlier attempts kept


class BatchQueue:
    """Jobs by id; `claim`/`renew`/`finish`/`release` for the workers; `purge` for retention."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._sessions = async_sessionmaker(engine, expire_on_commit=False)

    def _session(self) -> AsyncSession:
        return self._sessions()

    async def submit(
        self,
        tenant_id: str,
        model: str,
        requests: bytes,
        num_requests: int,
        *,
        max_pending: int | None = None,
        max_stored_bytes: int | None = None,
    ) -> str | Refused:
        """Queue a job, or say why not: the tenant already has `max_pending` unfinished (queued or
        running) jobs, or its jobs not yet purged hold `max_stored_bytes` (their requests and
        results) with this one's requests. The counts and the insert share a transaction: exact on
        SQLite (one writer), a soft cap across PostgreSQL replicas (two concurrent submits may both
        pass)."""
        job_id = str(uuid.uuid4())
        async with self._session() as s, s.begin():
            if max_pending is not None:
                pending = await s.scalar(
                    select(func.count())
                    .select_from(BatchJobRow)
                    .where(BatchJobRow.tenant_id == tenant_id, BatchJobRow.status.in_((QUEUED, RUNNING)))
                )
                if (pending or 0) >= max_pending:
                    return Refused("pending")
            if max_stored_bytes is not None:
                stored = await s.scalar(
                    select(
                        func.coalesce(
                            func.sum(
                                func.length(BatchJobRow.requests)
                                + func.coalesce(func.length(BatchJobRow.responses), 0)
                            ),
                            0,
                        )
                    ).where(BatchJobRow.tenant_id == tenant_id)
                )
                if int(stored or 0) + len(requests) > max_stored_bytes:
                    expiry = await s.scalar(
                        select(func.min(BatchJobRow.expires_at)).where(BatchJobRow.tenant_id == tenant_id)
                    )
                    return Refused("stored", int(stored or 0), expiry)
            s.add(
                BatchJobRow(
                    id=job_id,
                    tenant_id=tenant_id,
                    model=model,
                    status=QUEUED,
                    requests=requests,
                    num_requests=num_requests,
                    attempts=0,
                    created_at=now(),
                )
            )
        return job_id

    async def get(self, job_id: str, tenant_id: str) -> BatchJob | None:
        """The tenant's job (another tenant's is None, like an unknown, expired or malformed one)."""
        if not _is_job_id(job_id):  # the client's string: PostgreSQL refuses some (a NUL) outright
            return None
        async with self._session() as s:
            row = await s.get(BatchJobRow, job_id)
        if row is None or row.tenant_id != tenant_id:
            return None
        if row.expires_at is not None and row.expires_at <= now():
            return None
        return _job(row, responses=row.responses)

    async def claim(
        self, worker: str, lease_s: float, *, skip_tenants: Collection[str] = ()
    ) -> BatchJob | None:
        """Take the oldest job that is queued or whose lease has expired, or None; jobs of
        `skip_tenants` (those the worker already runs one of) are left to wait their turn, and those
        of a suspended tenant until it is resumed."""
        at = now()
        suspended = select(TenantRow.id).where(TenantRow.suspended_at.is_not(None))
        takeable = and_(
            or_(
                BatchJobRow.status == QUEUED,
                and_(BatchJobRow.status == RUNNING, BatchJobRow.lease_expires_at < at),
            ),
            BatchJobRow.tenant_id.not_in(suspended),
        )
        if skip_tenants:
            takeable = and_(takeable, BatchJobRow.tenant_id.not_in(list(skip_tenants)))
        candidates = (
            select(BatchJobRow.id, BatchJobRow.status, BatchJobRow.claimed_by)
            .where(takeable)
            .order_by(BatchJobRow.created_at)
            .limit(8)
        )
        lease_until = at + dt.timedelta(seconds=lease_s)
        while True:  # candidates all taken by others meanwhile: look again (someone made progress)
            if self._engine.dialect.name == "postgresql":
                # rows another gateway is taking right now are skipped, not waited for
                async with self._session() as s, s.begin():
                    locked = candidates.limit(1).with_for_update(skip_locked=True)  # lock only what we take
                    seen_rows = (await s.execute(locked)).all()
                    for seen in seen_rows:
                        job = await self._take(s, seen, takeable, worker, lease_until)
                        if job is not None:
                            return job
            else:
                # SQLite: read, then take each candidate in a write transaction of its own (a read
                # transaction cannot be upgraded once another connection has written)
                async with self._session() as s:
                    seen_rows = (await s.execute(candidates)).all()
                for seen in seen_rows:
                    async with self._session() as s, s.begin():
                        job = await self._take(s, seen, takeable, worker, lease_until)
                    if job is not None:
                        return job
            if not seen_rows:
                return None

    async def _take(
        self, s: AsyncSession, seen: Any, takeable: Any, worker: str, lease_until: dt.datetime
    ) -> BatchJob | None:
        """Compare-and-set: the job is ours only if it is still as we saw it."""
        job_id, status, claimed_by = seen
        unchanged = and_(BatchJobRow.status == status, _same(BatchJobRow.claimed_by, claimed_by))
        taken = await s.execute(
            update(BatchJobRow)
            .where(BatchJobRow.id == job_id, unchanged, takeable)
            .values(
                status=RUNNING,
                claimed_by=worker,
                lease_expires_at=lease_until,
                attempts=BatchJobRow.attempts + 1,
            )
            .execution_options(synchronize_session=False)
        )
        if taken.rowcount != 1:  # type: ignore[attr-defined]
            return None
        row = await s.get(BatchJobRow, job_id, populate_existing=True)
        assert row is not None
        kept = await s.execute(select(BatchAnswerRow).where(BatchAnswerRow.job_id == job_id))
        answers = {
            a.request_index: KeptAnswer(a.request_index, a.item, a.prompt_tokens, a.completion_tokens)
            for a in kept.scalars()
        }
        for a in _legacy_answers(row.progress, row.num_requests):  # an older gateway's (rolling upgrade)
            answers.setdefault(a.index, a)
        return _job(row, requests=row.requests, answers=tuple(answers.values()))

    async def renew(
        self, job_id: str, worker: str, lease_s: float, answers: Sequence[KeptAnswer] = ()
    ) -> bool:
        """Extend the lease and keep `answers` (those since the last renewal); False, keeping
        nothing, when the job is no longer this worker's."""
        values = {"lease_expires_at": now() + dt.timedelta(seconds=lease_s)}
        async with self._session() as s, s.begin():
            return await self._update_owned(s, job_id, worker, values, answers)

    async def finish(self, job_id: str, worker: str, responses: bytes, keep_s: float) -> bool:
        """Store the result (kept `keep_s` seconds); False when the job is no longer this worker's."""
        at = now()
        async with self._session() as s, s.begin():
            result = await s.execute(
                update(BatchJobRow)
                .where(
                    BatchJobRow.id == job_id, BatchJobRow.claimed_by == worker, BatchJobRow.status == RUNNING
                )
                .values(
                    status=DONE,
                    responses=responses,
                    finished_at=at,
                    expires_at=at + dt.timedelta(seconds=keep_s),
                    lease_expires_at=None,
                    requests=b"",  # the inputs are no longer needed; keep the table small
                    progress=None,
                )
            )
            if result.rowcount != 1:  # type: ignore[attr-defined]
                return False
            await s.execute(delete(BatchAnswerRow).where(BatchAnswerRow.job_id == job_id))
            return True

    async def release(
        self, job_id: str, worker: str, answers: Sequence[KeptAnswer] = (), *, is_attempt: bool = True
    ) -> None:
        """Hand a job back to the queue (this gateway is stopping), keeping `answers` (those since
        the last renewal): another gateway takes it at once, and runs only what is not kept.
        `is_attempt=False` (its tenant was suspended): the claim is not counted against the job's
        attempts, so suspensions and resumes never fail it."""
        values: dict[str, Any] = {"status": QUEUED, "claimed_by": None, "lease_expires_at": None}
        if not is_attempt:
            values["attempts"] = BatchJobRow.attempts - 1
        async with self._session() as s, s.begin():
            await self._update_owned(s, job_id, worker, values, answers)

    async def _update_owned(
        self, s: AsyncSession, job_id: str, worker: str, values: dict[str, Any], answers: Sequence[KeptAnswer]
    ) -> bool:
        """Update the job if it is still `worker`'s, and add `answers` to those it keeps; whether it was."""
        owned = await s.execute(
            update(BatchJobRow)
            .where(BatchJobRow.id == job_id, BatchJobRow.claimed_by == worker, BatchJobRow.status == RUNNING)
            .values(**values)
        )
        if owned.rowcount != 1:  # type: ignore[attr-defined]
            return False
        if answers:
            # a renewal whose commit was cut short is written again: the copy already there stays
            insert = pg_insert if self._engine.dialect.name == "postgresql" else sqlite_insert
            rows = [
                {
                    "job_id": job_id,
                    "request_index": a.index,
                    "item": a.item,
                    "prompt_tokens": a.prompt_tokens,
                    "completion_tokens": a.completion_tokens,
                }
                for a in answers
            ]
            await s.execute(insert(BatchAnswerRow).on_conflict_do_nothing(), rows)
        return True

    async def is_suspended(self, tenant_id: str) -> bool:
        """Whether the tenant is suspended (its running job is handed back to wait for the resume)."""
        async with self._session() as s:
            at = await s.scalar(select(TenantRow.suspended_at).where(TenantRow.id == tenant_id))
            return at is not None

    async def purge(self) -> int:
        """Delete finished jobs past their retention; returns how many."""
        async with self._session() as s, s.begin():
            result = await s.execute(
                delete(BatchJobRow).where(BatchJobRow.status == DONE, BatchJobRow.expires_at <= now())
            )
            return int(result.rowcount)  # type: ignore[attr-defined]


def _same(column: Any, value: str | None) -> Any:
    return column.is_(None) if value is None else column == value


def _job(
    row: BatchJobRow,
    *,
    requests: bytes | None = None,
    responses: bytes | None = None,
    answers: tuple[KeptAnswer, ...] = (),
) -> BatchJob:
    return BatchJob(
        id=row.id,
        tenant_id=row.tenant_id,
        model=row.model,
        status=row.status,
        num_requests=row.num_requests,
        attempts=row.attempts,
        requests=requests,
        responses=responses,
        answers=answers,
    )
