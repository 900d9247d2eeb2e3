"""Audit entries carry the admin request's id, to join them with the access log.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("audit") as batch:
        batch.add_column(sa.Column("request_id", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("audit") as batch:
        batch.drop_column("request_id")
