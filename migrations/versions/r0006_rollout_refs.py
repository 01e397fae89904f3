"""The rollout_refs projection: one rollout's lineage events without reading every lineage event.

`quiesce rollouts --rollout ID` folded every lineage event of the ledger to show one rollout, so it
grew with the whole history. This revision adds ``rollout_refs (rollout_id, seq)``: one row per
rollout id each lineage event names (``quiesce.ledger.rollout_refs.rollout_ids``), keyed by
rollout first, written with the event from now on, and backfilled here from the events already
stored — read a page at a time through the marker index (revision 0004), only the kinds that name
rollouts, in the upgrade's one transaction.

The kinds and the index predicate are frozen here; what each kind names is the projection's one
definition (``rollout_ids``), which ``quiesce replay`` rebuilds and compares against.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: ``quiesce.ledger.rollout_refs.REF_KINDS`` as of this revision, frozen here: a revision's backfill
#: must not change when the code's constant later does.
_KINDS = (
    "episodes.scoped",
    "episodes.exported",
    "episodes.restored",
    "episodes.retired",
    "rollouts.forgotten",
    "rollouts.captured",
    "rollouts.acknowledged",
    "rollouts.continued",
)
_SQLITE_WHERE = "kind NOT GLOB 'call.*' AND kind NOT GLOB 'phase.*'"
_PG_WHERE = "kind NOT LIKE 'call.%' AND kind NOT LIKE 'phase.%'"
#: Events read per query of the backfill.
PAGE = 2000


def upgrade() -> None:
    op.create_table(
        "rollout_refs",
        sa.Column("rollout_id", sa.String(256), primary_key=True),
        sa.Column("seq", sa.BigInteger(), primary_key=True, autoincrement=False),
        sqlite_with_rowid=False,  # one b-tree keyed by (rollout_id, seq)
    )
    backfill(op.get_bind())


def backfill(connection: sa.Connection) -> int:
    """Insert the refs of every stored event of the kinds that name rollouts; returns the rows."""
    from quiesce.ledger.rollout_refs import refs_of_rows

    where = _SQLITE_WHERE if connection.dialect.name == "sqlite" else _PG_WHERE
    kinds = ", ".join(f"'{kind}'" for kind in _KINDS)
    page = sa.text(
        f"SELECT seq, kind, data FROM events WHERE kind IN ({kinds}) AND seq > :after AND {where}"
        " ORDER BY seq LIMIT :n"
    )
    insert = sa.text("INSERT INTO rollout_refs (rollout_id, seq) VALUES (:rollout_id, :seq)")
    after, written = -(2**63), 0
    while True:
        rows = [tuple(row) for row in connection.execute(page, {"after": after, "n": PAGE})]
        refs = [{"rollout_id": r, "seq": s} for r, s in refs_of_rows(rows)]
        if refs:
            connection.execute(insert, refs)
            written += len(refs)
        if len(rows) < PAGE:
            return written
        after = int(rows[-1][0])


def downgrade() -> None:
    op.drop_table("rollout_refs")
