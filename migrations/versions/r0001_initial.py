"""The ledger: events (append-only, enforced by triggers) and the attempts projection.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SQLITE_TRIGGERS = (
    "CREATE TRIGGER events_no_update BEFORE UPDATE ON events "
    "BEGIN SELECT RAISE(ABORT, 'events is append-only'); END",
    "CREATE TRIGGER events_no_delete BEFORE DELETE ON events "
    "BEGIN SELECT RAISE(ABORT, 'events is append-only'); END",
)

_PG_TRIGGERS = (
    """
    CREATE FUNCTION quiesce_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        RAISE EXCEPTION 'events is append-only (% refused)', TG_OP USING ERRCODE = 'insufficient_privilege';
    END;
    $$
    """,
    "CREATE TRIGGER events_no_update_delete BEFORE UPDATE OR DELETE ON events "
    "FOR EACH ROW EXECUTE FUNCTION quiesce_events_append_only()",
    "CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events "
    "FOR EACH STATEMENT EXECUTE FUNCTION quiesce_events_append_only()",
)


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("seq", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
                  autoincrement=False),
        sa.Column("at", sa.String(32), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("checkpoint_id", sa.String(128), nullable=True),
        sa.Column("server", sa.String(256), nullable=True),
        sa.Column("call_id", sa.String(128), nullable=True),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.Text(), nullable=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
    )  # fmt: skip
    op.create_index("ix_events_checkpoint_id", "events", ["checkpoint_id", "seq"])
    op.create_index("ix_events_kind", "events", ["kind", "seq"])
    op.create_table(
        "attempts",
        sa.Column("checkpoint_id", sa.String(128), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("state", sa.String(64), nullable=False),
        sa.Column("outcome", sa.String(32), nullable=True),
        sa.Column("started_at", sa.String(32), nullable=False),
        sa.Column("ended_at", sa.String(32), nullable=True),
        sa.Column("deadline_ts", sa.Float(), nullable=True),
        sa.Column("participants", sa.Text(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("calls", sa.BigInteger(), nullable=False),
        sa.Column("failures", sa.BigInteger(), nullable=False),
        sa.Column("recovered_by", sa.BigInteger(), nullable=True),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sqlite_with_rowid=False,  # one b-tree keyed by checkpoint_id: fewer pages per append
    )
    dialect = op.get_bind().dialect.name
    for statement in _SQLITE_TRIGGERS if dialect == "sqlite" else _PG_TRIGGERS:
        op.execute(statement)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS events_no_update")
        op.execute("DROP TRIGGER IF EXISTS events_no_delete")
    else:
        op.execute("DROP TRIGGER IF EXISTS events_no_truncate ON events")
        op.execute("DROP TRIGGER IF EXISTS events_no_update_delete ON events")
        op.execute("DROP FUNCTION IF EXISTS quiesce_events_append_only()")
    op.drop_table("attempts")
    op.drop_index("ix_events_kind", table_name="events")
    op.drop_index("ix_events_checkpoint_id", table_name="events")
    op.drop_table("events")
