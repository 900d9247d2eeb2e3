"""Quota counters in the database, for gateways that share PostgreSQL without a Redis: the daily
neuron budget is reserved under a row lock there.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from gateway.store.tables import UTC

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "quota_counters",
        sa.Column("key", sa.String(200), primary_key=True),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("expires_at", UTC(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("quota_counters")
