"""Append-only, for inserts too: a row goes in only at the head of the chain.

Revision 0001 refuses UPDATE and DELETE (and TRUNCATE on PostgreSQL). That left a way round on
SQLite: ``REPLACE INTO events`` / ``INSERT OR REPLACE`` delete the row they collide with without
firing the DELETE trigger (SQLite fires delete triggers of a REPLACE only with
``recursive_triggers`` on), and an insert could still land anywhere. This revision adds a
``BEFORE INSERT`` trigger on both databases that refuses any row but the next one of the chain:
``seq`` = the last seq + 1 (1 on an empty table) and ``prev_hash`` = the last row's ``hash`` (the
genesis hash on an empty table). It runs before conflict handling, so REPLACE, ``INSERT OR
REPLACE``, UPSERT (``INSERT .. ON CONFLICT ..``, which on PostgreSQL is the only upsert besides
MERGE, whose update and delete branches fire the 0001 triggers) and a row slipped into the middle
are all refused. The writer's own appends always satisfy it (it checks the head in the same
transaction); each check is two lookups at the end of the seq index.

It also indexes ``attempts.last_seq``, so that opening a ledger for writing can compare the
largest seq the projection records with the stored head in one index lookup: a projection ahead
of the head means rows were removed from the end of ``events``.

Revision ID: 0003
Revises: 0002
Create Date: 2025-01-03
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_GENESIS = "0" * 64
_MESSAGE = (
    "events is append-only: a row may only be inserted at the head of the chain "
    "(seq = last seq + 1, prev_hash = the last row''s hash); "
    "REPLACE, UPSERT and inserts out of order are refused"
)

_SQLITE = (
    "CREATE TRIGGER events_insert_at_head BEFORE INSERT ON events "
    "WHEN NEW.seq IS NOT (SELECT coalesce(max(seq), 0) + 1 FROM events) "
    f"OR NEW.prev_hash IS NOT coalesce((SELECT hash FROM events ORDER BY seq DESC LIMIT 1), '{_GENESIS}') "
    f"BEGIN SELECT RAISE(ABORT, '{_MESSAGE}'); END"
)

_PG = (
    f"""
    CREATE FUNCTION quiesce_events_insert_at_head() RETURNS trigger LANGUAGE plpgsql AS $$
    DECLARE
        last_seq bigint;
        last_hash varchar(64);
    BEGIN
        SELECT seq, hash INTO last_seq, last_hash FROM events ORDER BY seq DESC LIMIT 1;
        IF NEW.seq IS DISTINCT FROM coalesce(last_seq, 0) + 1
           OR NEW.prev_hash IS DISTINCT FROM coalesce(last_hash, '{_GENESIS}') THEN
            RAISE EXCEPTION '{_MESSAGE}' USING ERRCODE = 'integrity_constraint_violation';
        END IF;
        RETURN NEW;
    END;
    $$
    """,
    "CREATE TRIGGER events_insert_at_head BEFORE INSERT ON events "
    "FOR EACH ROW EXECUTE FUNCTION quiesce_events_insert_at_head()",
)


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute(_SQLITE)
    else:
        for statement in _PG:
            op.execute(statement)
    op.create_index("ix_attempts_last_seq", "attempts", ["last_seq"])


def downgrade() -> None:
    op.drop_index("ix_attempts_last_seq", table_name="attempts")
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS events_insert_at_head")
    else:
        op.execute("DROP TRIGGER IF EXISTS events_insert_at_head ON events")
        op.execute("DROP FUNCTION IF EXISTS quiesce_events_insert_at_head()")
