"""A tenant's suspension: while `suspended_at` is set, its tokens are refused (403) and its queued
batch jobs wait; clearing it resumes both. Its tokens, quotas and usage stay as they were.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from gateway.store.tables import UTC

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("suspended_at", UTC(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("suspended_at")
