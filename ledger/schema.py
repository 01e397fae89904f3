"""SQLAlchemy Core definitions of the ledger's tables, at the head revision.

The tables are created and changed only by alembic (``migrations/``); this module describes them
for queries. ``tests/ledger/test_schema.py`` checks the two agree.

``events.data`` is the payload's canonical JSON *text* (not JSONB), so the hash chain can be
recomputed from the stored bytes on every backend.

The names that need no SQLAlchemy (``VERSION_TABLE``, ``HEAD_REVISION``, ``EVENT_COLUMNS``) live in
``quiesce.ledger.layout`` and are re-exported here.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Float, Index, Integer, MetaData, String, Table, Text, text

from quiesce.ledger.layout import (
    EVENT_COLUMNS,
    HEAD_REVISION,
    MARKER_WHERE_POSTGRESQL,
    MARKER_WHERE_SQLITE,
    VERSION_TABLE,
)

__all__ = [
    "EVENT_COLUMNS",
    "HEAD_REVISION",
    "VERSION_TABLE",
    "attempts",
    "events",
    "lease",
    "metadata",
    "rollout_refs",
]

metadata = MetaData()

# INTEGER PRIMARY KEY on SQLite makes seq the rowid (no second index); BIGINT elsewhere.
_SeqType = BigInteger().with_variant(Integer(), "sqlite")

events = Table(
    "events",
    metadata,
    Column("seq", _SeqType, primary_key=True, autoincrement=False),
    Column("at", String(32), nullable=False),
    Column("kind", String(64), nullable=False),
    Column("checkpoint_id", String(128), nullable=True),
    Column("server", String(256), nullable=True),
    Column("call_id", String(128), nullable=True),
    Column("epoch", BigInteger(), nullable=False),
    Column("data", Text(), nullable=False),
    Column("prev_hash", String(64), nullable=False),
    Column("hash", String(64), nullable=False),
)
Index("ix_events_checkpoint_id", events.c.checkpoint_id, events.c.seq)
#: Markers only (revision 0004): no ``call.*`` or ``phase.*`` row (``quiesce.ledger.layout.indexed_kind``).
Index(
    "ix_events_marker",
    events.c.kind,
    events.c.seq,
    sqlite_where=text(MARKER_WHERE_SQLITE),
    postgresql_where=text(MARKER_WHERE_POSTGRESQL),
)

attempts = Table(
    "attempts",
    metadata,
    Column("checkpoint_id", String(128), primary_key=True),
    Column("kind", String(16), nullable=False),
    Column("state", String(64), nullable=False),
    Column("outcome", String(32), nullable=True),
    Column("started_at", String(32), nullable=False),
    Column("ended_at", String(32), nullable=True),
    Column("deadline_ts", Float(), nullable=True),
    Column("participants", Text(), nullable=False),
    Column("epoch", BigInteger(), nullable=False),
    Column("calls", BigInteger(), nullable=False),
    Column("failures", BigInteger(), nullable=False),
    Column("recovered_by", BigInteger(), nullable=True),
    Column("last_seq", BigInteger(), nullable=False),
    sqlite_with_rowid=False,
)
#: The largest seq the projection records, read at a writer's open (``Ledger.connect``).
Index("ix_attempts_last_seq", attempts.c.last_seq)
#: `history`'s order (revision 0005): its newest N rows, or a page from any point, in O(N).
Index("ix_attempts_started", attempts.c.started_at, attempts.c.checkpoint_id)

#: Which rollouts each lineage event names (revision 0006; ``quiesce.ledger.rollout_refs``): written
#: with the event, rebuilt and compared by replay. Keyed by rollout first: one rollout's seqs are one
#: range of the key (SQLite: one b-tree, no rowid).
rollout_refs = Table(
    "rollout_refs",
    metadata,
    Column("rollout_id", String(256), primary_key=True),
    Column("seq", BigInteger(), primary_key=True, autoincrement=False),
    sqlite_with_rowid=False,
)

#: The coordinator lease (PostgreSQL standby takeover; unused on SQLite): one row per lease name.
#: ``expires_at`` is Unix seconds on the database server's clock.
lease = Table(
    "quiesce_lease",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("holder", String(256), nullable=False),
    Column("epoch", BigInteger(), nullable=False),
    Column("expires_at", Float(precision=53), nullable=False),
    Column("writer_pid", Integer(), nullable=True),
)
