"""A running batch job's finished requests, kept when it is handed back (a drain, a deploy) or its
lease renewed, so the gateway that takes it over runs (and bills) only the rest.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batch_jobs") as batch:
        batch.add_column(sa.Column("progress", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batch_jobs") as batch:
        batch.drop_column("progress")
