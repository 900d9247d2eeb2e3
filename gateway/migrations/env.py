"""Alembic environment for the tenant store, run in-process by `gateway.store.migrate`.

There is no alembic.ini: the caller builds the `Config` in code and hands over an open
connection in `config.attributes["connection"]` (Alembic's "sharing a connection" recipe), so
migrations run on the same (async-wrapped) engine the gateway uses.
"""

from __future__ import annotations

from alembic import context

from gateway.store.tables import Table

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Table.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
