"""Schema management through alembic, programmatically (no alembic.ini).

The only ways a schema changes are ``upgrade`` (``quiesce db upgrade``, which also restores
append-only triggers someone dropped: ``restore_triggers_sync``) and, for an empty database
opened by a writer, creation at head (``ensure_schema(create=True)``). Opening checks the
stored revision: behind head is refused with the command that upgrades, ahead of this code is
refused with a request to upgrade quiesce.

An *empty* database is one with neither the version table nor an ``events`` table. A writer open
creates it at head on SQLite and PostgreSQL alike (the caller holds the writer lock, so two
openers cannot both create it); a readonly open refuses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, inspect, text

from quiesce.ledger.errors import LedgerError
from quiesce.ledger.layout import APPEND_ONLY_TRIGGERS
from quiesce.ledger.schema import VERSION_TABLE

State = Literal["empty", "current", "behind", "ahead", "unmanaged"]


#: quiesce's alembic environment: the `migrations` folder installed beside this package, found by
#: its location — never by importing the name `migrations`, which a user's own project (Django,
#: its own alembic) may provide first on `sys.path`.
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def _script_location() -> str:
    return str(MIGRATIONS_DIR)


def alembic_config(connection: Connection | None = None) -> Config:
    """An alembic config for the ledger's migrations, bound to ``connection`` when given."""
    cfg = Config()
    cfg.set_main_option("script_location", _script_location())
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


_HEAD: str | None = None


def head_revision() -> str:
    """The head revision this code was written for."""
    global _HEAD
    if _HEAD is None:
        head = ScriptDirectory.from_config(alembic_config()).get_current_head()
        assert head is not None, "migrations/versions has no revision"
        _HEAD = head
    return _HEAD


def current_revision(connection: Connection) -> str | None:
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def schema_state(connection: Connection) -> tuple[State, str | None]:
    """Where the schema of ``connection``'s database stands relative to this code."""
    tables = set(inspect(connection).get_table_names())
    if VERSION_TABLE not in tables:
        return ("unmanaged" if "events" in tables else "empty"), None
    current = current_revision(connection)
    head = head_revision()
    if current == head:
        return "current", current
    if current is None:
        return "behind", None
    try:
        ScriptDirectory.from_config(alembic_config()).get_revision(current)
    except CommandError:
        return "ahead", current
    return "behind", current


def upgrade_sync(connection: Connection) -> tuple[str | None, str]:
    """Upgrade to head in the caller's transaction; returns (revision before, revision after)."""
    state, before = schema_state(connection)
    if state == "ahead":
        raise LedgerError(ahead_message(before))
    if state == "unmanaged":
        raise LedgerError(
            "this database has an events table that quiesce's migrations did not create "
            f"(no {VERSION_TABLE} table); use another database for the ledger"
        )
    if state != "current":
        command.upgrade(alembic_config(connection), "head")
    return before, head_revision()


def restore_triggers_sync(connection: Connection) -> list[str]:
    """Recreate the append-only triggers missing from a ledger at head, each with the statements
    of the revision that created it (a dropped trigger leaves its PostgreSQL function behind: it
    is replaced); returns the names restored. The caller holds writership and the transaction."""
    from quiesce.migrations.versions import r0001_initial, r0003_insert_at_head

    dialect = connection.dialect.name
    key = "sqlite" if dialect == "sqlite" else "postgresql"
    if key == "sqlite":
        query = "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'events'"
        update, delete = r0001_initial._SQLITE_TRIGGERS
        statements = {
            "events_no_update": [update],
            "events_no_delete": [delete],
            "events_insert_at_head": [r0003_insert_at_head._SQLITE],
        }
    else:
        query = "SELECT tgname FROM pg_trigger WHERE tgrelid = to_regclass('events') AND NOT tgisinternal"
        function, update_delete, truncate = r0001_initial._PG_TRIGGERS
        at_head_function, at_head = r0003_insert_at_head._PG
        statements = {
            "events_no_update_delete": [_or_replace(function), update_delete],
            "events_no_truncate": [_or_replace(function), truncate],
            "events_insert_at_head": [_or_replace(at_head_function), at_head],
        }
    present = {str(row[0]) for row in connection.execute(text(query))}
    missing = [name for name in APPEND_ONLY_TRIGGERS[key] if name not in present]
    for name in missing:
        for statement in statements[name]:
            connection.exec_driver_sql(statement)
    return missing


def _or_replace(statement: str) -> str:
    return statement.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def downgrade_sync(connection: Connection, revision: str) -> None:
    """Downgrade to ``revision`` (``"base"`` drops everything). For tests and emergencies only."""
    command.downgrade(alembic_config(connection), revision)


def ahead_message(current: str | None) -> str:
    return (
        f"the ledger's schema is at revision {current}, newer than this quiesce knows "
        f"(head {head_revision()}); "
        "upgrade quiesce to a version that knows it"
    )


def ensure_schema_sync(connection: Connection, *, url: str, create: bool) -> None:
    """Refuse a schema that is not at head; create an empty database at head when ``create``."""
    state, current = schema_state(connection)
    if state == "current":
        return
    if state == "empty":
        if not create:
            raise LedgerError(
                f"no ledger in {url}: open it once as a writer or run `quiesce db upgrade --ledger {url}`"
            )
        command.upgrade(alembic_config(connection), "head")
        return
    if state == "behind":
        raise LedgerError(
            f"the ledger's schema is behind this quiesce (at {current or 'base'}, head {head_revision()}); "
            f"run `quiesce db upgrade --ledger {url}` and open it again"
        )
    if state == "ahead":
        raise LedgerError(ahead_message(current))
    raise LedgerError(
        f"{url} has an events table that quiesce's migrations did not create (no {VERSION_TABLE} table); "
        "use another database for the ledger"
    )
