"""Names of the stored layout that the read and write paths need without SQLAlchemy.

``quiesce.ledger.schema`` (the SQLAlchemy Core tables) re-exports them; the SQLite backend, which talks
to the database through the standard library's ``sqlite3``, imports them from here so opening a
ledger at head loads no SQLAlchemy.
"""

from __future__ import annotations

from typing import Final

#: Alembic's version table for quiesce (a database may be shared with an application).
VERSION_TABLE: Final = "quiesce_alembic_version"
#: The head revision of `migrations/versions` (checked against alembic by the tests). Opening a
#: ledger whose stored revision equals it skips alembic entirely — the common case, kept cheap.
HEAD_REVISION: Final = "0007"

#: The triggers on ``events`` that make it append-only at the head revision, per dialect (revision
#: 0001: no UPDATE, DELETE or TRUNCATE; revision 0003: inserts only at the head of the chain). A
#: writer refuses a ledger that lacks one (``quiesce.ledger.store``); ``quiesce db upgrade`` restores them.
APPEND_ONLY_TRIGGERS: Final = {
    "sqlite": ("events_insert_at_head", "events_no_delete", "events_no_update"),
    "postgresql": ("events_insert_at_head", "events_no_truncate", "events_no_update_delete"),
}

#: The ``rollout_refs`` projection (revision 0006): one row per rollout id a lineage event names.
ROLLOUT_REFS: Final = "rollout_refs"

#: The columns of ``events``, in table order (``quiesce.ledger.backend.RawEvent`` follows it).
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

#: Kind prefixes of the per-call and per-phase events — about nine events in ten. Revision 0004
#: keeps them out of the kind index (``ix_events_marker``), so a transaction of the save's hot path
#: writes no kind-index page; every other kind (attempt, discovery, coordinator, recovery and
#: lease events: the rare markers a lookup by kind looks for) stays indexed.
UNINDEXED_KIND_PREFIXES: Final = ("call.", "phase.")
#: The kind index's predicate, per dialect (GLOB on SQLite: its LIKE follows a connection pragma,
#: which an index must not). A query by kind uses the index only when its WHERE carries this text
#: verbatim (neither database proves ``kind = ?`` implies it): see ``indexed_kind``.
MARKER_WHERE_SQLITE: Final = "kind NOT GLOB 'call.*' AND kind NOT GLOB 'phase.*'"
MARKER_WHERE_POSTGRESQL: Final = "kind NOT LIKE 'call.%' AND kind NOT LIKE 'phase.%'"


def indexed_kind(kind: str) -> bool:
    """Whether events of ``kind`` are in the kind index (``ix_events_marker``)."""
    return not kind.startswith(UNINDEXED_KIND_PREFIXES)
