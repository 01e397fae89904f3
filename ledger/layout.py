"""Names of the stored layout that the read and write paths need without SQLAlchemy.

``ledger.schema`` (the SQLAlchemy Core tables) re-exports them; the SQLite backend, which talks
to the database through the standard library's ``sqlite3``, imports them from here so opening a
ledger at head loads no SQLAlchemy.
"""

from __future__ import annotations

from typing import Final

#: Alembic's version table for quiesce (a database may be shared with an application).
VERSION_TABLE: Final = "quiesce_alembic_version"
#: The head revision of `migrations/versions` (checked against alembic by the tests). Opening a
#: ledger whose stored revision equals it skips alembic entirely — the common case, kept cheap.
HEAD_REVISION: Final = "0003"

#: The columns of ``events``, in table order (``ledger.backend.RawEvent`` follows it).
EVENT_COLUMNS: Final = (
    "seq",
    "at",
    "kind",
    "checkpoint_id",
    "server",
    "call_id",
    "epoch",
    "data",
    "prev_hash",
    "hash",
)
