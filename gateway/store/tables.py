"""The tenant store's tables (SQLAlchemy 2 declarative). Alembic's migrations create them;
`tests/gateway/test_store.py` checks that the two agree.

Timestamps are stored as naive UTC (SQLite keeps no zone) and come back zone-aware through `UTC`.
Tokens keep only a SHA-256 of their value; usage rows are append-only and small (reliability §4.6).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# an autoincrementing 64-bit key; SQLite only autoincrements INTEGER PRIMARY KEY
RowId = BigInteger().with_variant(Integer(), "sqlite")


class UTC(TypeDecorator[dt.datetime]):
    """A zone-aware UTC datetime stored as naive UTC on every dialect."""

    impl = DateTime(timezone=False)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(dt.UTC).replace(tzinfo=None)

    def process_result_value(self, value: Any, dialect: Dialect) -> dt.datetime | None:
        return None if value is None else value.replace(tzinfo=dt.UTC)


class Table(DeclarativeBase):
    pass


class TenantRow(Table):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    plan: Mapped[str] = mapped_column(String(8))
    created_at: Mapped[dt.datetime] = mapped_column(UTC())
    deleted_at: Mapped[dt.datetime | None] = mapped_column(UTC(), nullable=True)
    suspended_at: Mapped[dt.datetime | None] = mapped_column(UTC(), nullable=True)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    daily_neurons: Mapped[float | None] = mapped_column(Float, nullable=True)
    allowed_models: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)


class TokenRow(Table):
    __tablename__ = "tokens"
    __table_args__ = (Index("ix_tokens_tenant_id", "tenant_id"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32), ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(String(200))
    secret_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(UTC())
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTC(), nullable=True)
    last_used_at: Mapped[dt.datetime | None] = mapped_column(UTC(), nullable=True)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTC(), nullable=True)


class AdminTokenRow(Table):
    __tablename__ = "admin_tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    secret_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(UTC())


class UsageRow(Table):
    __tablename__ = "usage"
    __table_args__ = (Index("ix_usage_tenant_day", "tenant_id", "day"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(256))
    request_id: Mapped[str] = mapped_column(String(128))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    neurons: Mapped[float] = mapped_column(Float)
    status: Mapped[int] = mapped_column(Integer)
    at: Mapped[dt.datetime] = mapped_column(UTC())
    day: Mapped[dt.date] = mapped_column(Date)


class AuditRow(Table):
    __tablename__ = "audit"
    __table_args__ = (Index("ix_audit_tenant_id", "tenant_id"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = mapped_column(UTC())
    actor: Mapped[str] = mapped_column(String(200))
    request_id: Mapped[str | None] = mapped_column(String(128), nullable=True)  # revision 0002
    action: Mapped[str] = mapped_column(String(64))
    tenant_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    object_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)


class BatchJobRow(Table):
    """An async batch job (revision 0003): its requests in, its responses out, and who runs it.
    `status` is queued → running → done; a running job whose `lease_expires_at` has passed is
    taken again by any gateway (its gateway died)."""

    __tablename__ = "batch_jobs"
    __table_args__ = (Index("ix_batch_jobs_status_created", "status", "created_at"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(8))
    requests: Mapped[bytes] = mapped_column(LargeBinary)  # the submitted JSON array
    num_requests: Mapped[int] = mapped_column(Integer)
    responses: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)  # the result JSON
    attempts: Mapped[int] = mapped_column(Integer)
    claimed_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(UTC(), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTC())
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTC(), nullable=True)
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTC(), nullable=True)
    # revision 0005's answers (one JSON list), written only by gateways of the release before 0006
    # during a rolling upgrade: read when a job is claimed, cleared when it finishes
    progress: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)


class BatchAnswerRow(Table):
    """One request of a running batch job, answered for good (revision 0006): written once, by the
    lease renewal or hand-back that follows its answer, so the gateway that takes the job over runs
    (and bills) only the others. Deleted when the job finishes: its result holds them all."""

    __tablename__ = "batch_answers"

    job_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    request_index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    item: Mapped[bytes] = mapped_column(LargeBinary)  # the `schemas.batch.BatchItem`, JSON
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)


class CounterRow(Table):
    """A quota counter shared by gateways that have PostgreSQL and no Redis (revision 0004): today
    each tenant's day of neurons, reserved under a row lock (`gateway.store.counters`), with the
    generation it was seeded with (revision 0007); and the markers of settlements made, one a
    request for a few minutes, swept by `expires_at` (indexed: the sweep runs on seeding)."""

    __tablename__ = "quota_counters"
    __table_args__ = (Index("ix_quota_counters_expires_at", "expires_at"),)

    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    value: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[dt.datetime] = mapped_column(UTC())
    generation: Mapped[str | None] = mapped_column(String(32), nullable=True)  # none: a marker, or older
