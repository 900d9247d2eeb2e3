"""The async batch queue (`?queueRequest=true`): one row per job, shared by every gateway.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from gateway.store.tables import UTC

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batch_jobs",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("status", sa.String(8), nullable=False),
        sa.Column("requests", sa.LargeBinary(), nullable=False),
        sa.Column("num_requests", sa.Integer(), nullable=False),
        sa.Column("responses", sa.LargeBinary(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("claimed_by", sa.String(128), nullable=True),
        sa.Column("lease_expires_at", UTC(), nullable=True),
        sa.Column("created_at", UTC(), nullable=False),
        sa.Column("finished_at", UTC(), nullable=True),
        sa.Column("expires_at", UTC(), nullable=True),
    )
    op.create_index("ix_batch_jobs_status_created", "batch_jobs", ["status", "created_at"])


def downgrade() -> None:
    op.drop_table("batch_jobs")
