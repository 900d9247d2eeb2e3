"""A running batch job's answered requests move from one `progress` column (the whole list, rewritten
at every lease renewal: quadratic in the job) to a row each, written once.

The answers that jobs kept in `progress` are copied into rows, so a job handed back before the
upgrade is taken over without running (and billing) them again. The column stays (emptied): gateways
of the release before, still running during a rolling upgrade, read and write it on every batch
query (dropped, their polls, renewals and finishes all failed), and a job they keep there is read
back by the new ones when they claim it (`gateway/store/batch.py`). A later revision drops it.

Revision ID: 0006
Revises: 0005
"""

# no `from __future__ import annotations`: Alembic loads this file outside `sys.modules`, where
# msgspec could not resolve `Answered`'s annotations as strings
import msgspec
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

jobs = sa.table(
    "batch_jobs",
    sa.column("id", sa.String),
    sa.column("num_requests", sa.Integer),
    sa.column("progress", sa.LargeBinary),
)
answers = sa.table(
    "batch_answers",
    sa.column("job_id", sa.String),
    sa.column("request_index", sa.Integer),
    sa.column("item", sa.LargeBinary),
    sa.column("prompt_tokens", sa.Integer),
    sa.column("completion_tokens", sa.Integer),
)


class Answered(msgspec.Struct):
    """One entry of revision 0005's `progress` (`gateway.batch.Answered` as it was then)."""

    index: int
    item: msgspec.Raw
    prompt_tokens: int
    completion_tokens: int


def upgrade() -> None:
    op.create_table(
        "batch_answers",
        sa.Column("job_id", sa.String(36), primary_key=True),
        sa.Column("request_index", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("item", sa.LargeBinary(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
    )
    bind = op.get_bind()
    kept = bind.execute(sa.select(jobs.c.id, jobs.c.num_requests).where(jobs.c.progress.is_not(None))).all()
    decoder = msgspec.json.Decoder(list[Answered])
    for job_id, num_requests in kept:  # one job's progress in memory at a time
        data = bind.execute(sa.select(jobs.c.progress).where(jobs.c.id == job_id)).scalar_one()
        try:
            entries = {a.index: a for a in decoder.decode(data) if 0 <= a.index < num_requests}
        except msgspec.DecodeError:  # unreadable, as the worker treated it: its requests run again
            continue
        if entries:
            bind.execute(
                answers.insert(),
                [
                    {
                        "job_id": job_id,
                        "request_index": a.index,
                        "item": bytes(a.item),
                        "prompt_tokens": a.prompt_tokens,
                        "completion_tokens": a.completion_tokens,
                    }
                    for a in entries.values()
                ],
            )
    bind.execute(jobs.update().where(jobs.c.progress.is_not(None)).values(progress=None))


def downgrade() -> None:
    bind = op.get_bind()
    job_ids = bind.execute(sa.select(answers.c.job_id).distinct()).scalars().all()
    for job_id in job_ids:
        rows = bind.execute(
            sa.select(answers).where(answers.c.job_id == job_id).order_by(answers.c.request_index)
        ).all()
        progress = [
            Answered(r.request_index, msgspec.Raw(r.item), r.prompt_tokens, r.completion_tokens) for r in rows
        ]
        bind.execute(jobs.update().where(jobs.c.id == job_id).values(progress=msgspec.json.encode(progress)))
    op.drop_table("batch_answers")
