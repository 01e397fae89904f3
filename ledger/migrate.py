"""Schema management through alembic, programmatically (no alembic.ini).

The only ways a schema changes are ``upgrade`` (``quiesce db upgrade``) and, for an empty
database opened by a writer, creation at head (``ensure_schema(create=True)``). Opening checks the
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
from sqlalchemy import Connection, inspect

from quiesce.ledger.errors import LedgerError
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
