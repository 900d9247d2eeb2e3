"""Initial schema: tenants, tokens, admin tokens, usage ledger, audit log.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from gateway.store.tables import UTC, RowId

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("plan", sa.String(8), nullable=False),
        sa.Column("created_at", UTC(), nullable=False),
        sa.Column("deleted_at", UTC(), nullable=True),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("daily_neurons", sa.Float(), nullable=True),
        sa.Column("allowed_models", sa.JSON(), nullable=True),
    )
    op.create_table(
        "tokens",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(32), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("secret_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", UTC(), nullable=False),
        sa.Column("expires_at", UTC(), nullable=True),
        sa.Column("last_used_at", UTC(), nullable=True),
        sa.Column("revoked_at", UTC(), nullable=True),
    )
    op.create_index("ix_tokens_tenant_id", "tokens", ["tenant_id"])
    op.create_table(
        "admin_tokens",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("secret_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", UTC(), nullable=False),
    )
    op.create_table(
        "usage",
        sa.Column("id", RowId, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("neurons", sa.Float(), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("at", UTC(), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
    )
    op.create_index("ix_usage_tenant_day", "usage", ["tenant_id", "day"])
    op.create_table(
        "audit",
        sa.Column("id", RowId, primary_key=True, autoincrement=True),
        sa.Column("at", UTC(), nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=True),
        sa.Column("object_id", sa.String(32), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=False),
    )
    op.create_index("ix_audit_tenant_id", "audit", ["tenant_id"])


def downgrade() -> None:
    op.drop_table("audit")
    op.drop_table("usage")
    op.drop_table("admin_tokens")
    op.drop_table("tokens")
    op.drop_table("tenants")
