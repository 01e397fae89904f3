"""Alembic environment for the ledger schema.

Runs only through ``quiesce.ledger.migrate``, which passes an open SQLAlchemy connection in
``config.attributes["connection"]`` (from an async engine via ``run_sync``). No alembic.ini:
the configuration is built in code so it works from an installed package.
"""

from __future__ import annotations

from alembic import context

from quiesce.ledger.schema import VERSION_TABLE

config = context.config
connection = config.attributes.get("connection")
if connection is None or context.is_offline_mode():
    raise RuntimeError(
        "the ledger's migrations run through quiesce.ledger.migrate (quiesce db upgrade), online only"
    )

context.configure(connection=connection, target_metadata=None, version_table=VERSION_TABLE)
with context.begin_transaction():
    context.run_migrations()
