"""The store's append-only rows: the usage ledger and the audit log, read and written inside a
session the `Store` opens (it owns transactions; these functions only build and run queries)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, Literal

from sqlalchemy import case, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.store.tables import AuditRow, UsageRow
from schemas.admin import AuditEntry, UsageGroup, UsageRecord


def add_usage(s: AsyncSession, records: Sequence[UsageRecord]) -> None:
    """Append usage rows, each filed under the UTC day of its `at`."""
    s.add_all(
        UsageRow(
            tenant_id=r.tenant_id,
            model=r.model,
            request_id=r.request_id,
            prompt_tokens=r.prompt_tokens,
            cached_tokens=r.cached_tokens,
            completion_tokens=r.completion_tokens,
            neurons=r.neurons,
            status=r.status,
            at=r.at,
            day=r.at.astimezone(dt.UTC).date(),
        )
        for r in records
    )


async def usage_groups(
    s: AsyncSession, tenant_id: str, *, since: dt.date, until: dt.date, group_by: Literal["day", "model"]
) -> list[UsageGroup]:
    """Usage per UTC day or per model, `since` and `until` inclusive."""
    key: Any = UsageRow.day if group_by == "day" else UsageRow.model
    query = (
        select(
            key,
            func.count(),
            func.sum(case((UsageRow.status >= 400, 1), else_=0)),
            func.sum(UsageRow.prompt_tokens),
            func.sum(UsageRow.cached_tokens),
            func.sum(UsageRow.completion_tokens),
            func.sum(UsageRow.neurons),
        )
        .where(UsageRow.tenant_id == tenant_id, UsageRow.day >= since, UsageRow.day <= until)
        .group_by(key)
        .order_by(key)
    )
    rows = (await s.execute(query)).all()
    return [
        UsageGroup(
            day=k.isoformat() if group_by == "day" else None,
            model=str(k) if group_by == "model" else None,
            requests=int(n),
            failed_requests=int(f),
            prompt_tokens=int(p),
            cached_tokens=int(c),
            completion_tokens=int(o),
            neurons=float(x),
        )
        for k, n, f, p, c, o, x in rows
    ]


async def neurons_on(s: AsyncSession, tenant_id: str, day: dt.date) -> float:
    """A tenant's neurons on one UTC day (what seeds the daily quota counter)."""
    total = await s.scalar(
        select(func.sum(UsageRow.neurons)).where(UsageRow.tenant_id == tenant_id, UsageRow.day == day)
    )
    return float(total or 0.0)


async def audit_page(
    s: AsyncSession, *, page: int, per_page: int, tenant_id: str | None
) -> tuple[list[AuditEntry], int]:
    """Newest first."""
    where = [] if tenant_id is None else [AuditRow.tenant_id == tenant_id]
    total = await s.scalar(select(func.count()).select_from(AuditRow).where(*where)) or 0
    rows = await s.scalars(
        select(AuditRow)
        .where(*where)
        .order_by(AuditRow.id.desc())
        .offset((page - 1) * per_page)
        .limit(per_page)
    )
    entries = [
        AuditEntry(
            id=r.id,
            at=r.at,
            actor=r.actor,
            request_id=r.request_id,
            action=r.action,
            tenant_id=r.tenant_id,
            object_id=r.object_id,
            detail=r.detail,
        )
        for r in rows
    ]
    return entries, total
