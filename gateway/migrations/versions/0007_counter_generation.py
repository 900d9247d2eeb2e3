"""A quota counter's generation, set when it is seeded from the ledger: a settlement refunds a
reservation only on the counter it was made on, never on one seeded since (which lacks it). And an
index on `expires_at`: settlement markers (a row a request) are swept by it.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("quota_counters") as batch:
        batch.add_column(sa.Column("generation", sa.String(32), nullable=True))
    # settlement markers (a row a request for a few minutes) are swept by expiry on every seed
    op.create_index("ix_quota_counters_expires_at", "quota_counters", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_quota_counters_expires_at", table_name="quota_counters")
    with op.batch_alter_table("quota_counters") as batch:
        batch.drop_column("generation")
