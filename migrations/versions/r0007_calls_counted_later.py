"""``attempts`` counts a ``call.sent`` with the next event that touches its row.

Until revision 0006 every ``call.sent`` rewrote its attempt's row (``calls`` + 1, ``last_seq``), so
a recorded call cost the events row plus two projection pages (the row and its ``last_seq`` index
entry). From this revision a ``call.sent`` changes no row: the next event touching the row counts
the calls sent since its ``last_seq`` (``quiesce.ledger.projections``), and a reader adds the calls
after ``last_seq`` (``Ledger.attempts``). A row whose last change was a ``call.sent`` — an attempt
whose coordinator died in the middle of a phase, never recovered — is stored differently under the
two rules; the upgrade rewrites exactly those rows, so ``replay`` and ``check`` compare them equal:
``last_seq`` goes back to the last event that touched the row otherwise, and ``calls`` loses the
calls sent after it. The downgrade counts every call after ``last_seq`` back in. Both are one
transaction; neither reads the history beyond those rows' own events.

The kinds are frozen here, as of this revision.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SQLITE_MARKER = "kind NOT GLOB 'call.*' AND kind NOT GLOB 'phase.*'"
_PG_MARKER = "kind NOT LIKE 'call.%' AND kind NOT LIKE 'phase.%'"

_LAST_WAS_A_CALL = sa.text(
    "SELECT a.checkpoint_id, a.last_seq, a.calls FROM attempts a JOIN events e ON e.seq = a.last_seq"
    " WHERE e.kind = 'call.sent' AND e.checkpoint_id = a.checkpoint_id"
)
#: The last event of the id before ``old`` that touches its row (any kind but the two call records).
_LAST_OWN_TOUCH = sa.text(
    "SELECT max(seq) FROM events WHERE checkpoint_id = :cid AND seq < :old"
    " AND kind NOT IN ('call.sent', 'call.replied')"
)
_CALLS_SINCE = sa.text(
    "SELECT count(*) FROM events WHERE checkpoint_id = :cid AND kind = 'call.sent'"
    " AND seq > :after AND seq <= :old"
)
_SET = sa.text("UPDATE attempts SET last_seq = :last, calls = :calls WHERE checkpoint_id = :cid")

_COUNT_LATER_CALLS = sa.text(
    "UPDATE attempts SET"
    " calls = calls + (SELECT count(*) FROM events e WHERE e.checkpoint_id = attempts.checkpoint_id"
    " AND e.kind = 'call.sent' AND e.seq > attempts.last_seq),"
    " last_seq = coalesce((SELECT max(e.seq) FROM events e WHERE e.checkpoint_id = attempts.checkpoint_id"
    " AND e.kind = 'call.sent' AND e.seq > attempts.last_seq), last_seq)"
)


def _recovery_naming(connection: sa.Connection, cid: str, after: int, old: int) -> int | None:
    """The last ``recovery.completed`` in ``(after, old)`` whose ``outcomes`` name ``cid`` (it
    touches that row whatever its own checkpoint id)."""
    marker = _SQLITE_MARKER if connection.dialect.name == "sqlite" else _PG_MARKER
    rows = connection.execute(
        sa.text(
            "SELECT seq, data FROM events WHERE kind = 'recovery.completed' AND seq > :after AND seq < :old"
            f" AND {marker} ORDER BY seq DESC"
        ),
        {"after": after, "old": old},
    )
    for seq, data in rows:
        try:
            outcomes = json.loads(data).get("outcomes")
        except (ValueError, AttributeError):
            continue
        if isinstance(outcomes, dict) and cid in outcomes:
            return int(seq)
    return None


def upgrade() -> None:
    connection = op.get_bind()
    for cid, old, calls in list(connection.execute(_LAST_WAS_A_CALL)):
        own = connection.execute(_LAST_OWN_TOUCH, {"cid": cid, "old": old}).scalar()
        last = int(own) if own is not None else 0
        named = _recovery_naming(connection, cid, last, int(old))
        if named is not None:
            last = named
        later = int(connection.execute(_CALLS_SINCE, {"cid": cid, "after": last, "old": old}).scalar() or 0)
        connection.execute(_SET, {"cid": cid, "last": last, "calls": int(calls) - later})


def downgrade() -> None:
    op.get_bind().execute(_COUNT_LATER_CALLS)
