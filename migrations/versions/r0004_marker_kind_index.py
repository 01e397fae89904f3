"""The kind index holds the rare marker events only.

Revision 0001 indexed every event by ``(kind, seq)``. Lookups by kind only ever look for rare
markers (the last ``attempt.started`` or ``discovery.completed``, the coordinators and recoveries
an audit bundle names), while about nine events in ten are per-call and per-phase events
(``call.*``, ``phase.*``). Those scattered every transaction of a save over several leaf pages of
the kind index: about a third of the pages a save writes to the WAL, and the most CPU of any
index. This revision replaces ``ix_events_kind`` with ``ix_events_marker``: the same columns,
without the ``call.*`` and ``phase.*`` rows. A query by kind names the predicate verbatim to use
it (``quiesce.ledger.layout.MARKER_WHERE_*``; neither database proves ``kind = ?`` implies it).

The predicate's text is frozen here: a later change to the constants needs a new revision.

Revision ID: 0004
Revises: 0003
Create Date: 2025-01-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SQLITE_WHERE = "kind NOT GLOB 'call.*' AND kind NOT GLOB 'phase.*'"
_PG_WHERE = "kind NOT LIKE 'call.%' AND kind NOT LIKE 'phase.%'"


def upgrade() -> None:
    op.drop_index("ix_events_kind", table_name="events")
    op.create_index(
        "ix_events_marker",
        "events",
        ["kind", "seq"],
        sqlite_where=sa.text(_SQLITE_WHERE),
        postgresql_where=sa.text(_PG_WHERE),
    )


def downgrade() -> None:
    op.drop_index("ix_events_marker", table_name="events")
    op.create_index("ix_events_kind", "events", ["kind", "seq"])
