"""The attempts projection indexed by start: `history --limit N` reads N rows, not every attempt.

`history` lists attempts by ``(started_at, checkpoint_id)``; its most recent N were found by
reading every row of the projection and slicing, so it grew with the history (linear in attempts).
This revision indexes that order, so the newest N come from the end of the index in O(N), and
a page of attempts from any point of it.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_attempts_started", "attempts", ["started_at", "checkpoint_id"])


def downgrade() -> None:
    op.drop_index("ix_attempts_started", table_name="attempts")
