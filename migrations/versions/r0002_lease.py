"""The coordinator lease: one row that says which coordinator is active, until when.

A standby coordinator (PostgreSQL) waits for ``expires_at`` to pass, then takes the row over
(see ``quiesce.ledger.postgres`` for the statements and ``quiesce.coordinator.lease`` for the renewal task).
``writer_pid`` is the holder's writer session (``pg_backend_pid``): the one session a standby may
end with ``pg_terminate_backend`` once the lease has expired.
``expires_at`` is in Unix seconds of the *database server's* clock, so coordinators on hosts with
skewed clocks still agree on when a lease ran out. The table exists on SQLite too (one schema for
both backends) but is unused there: SQLite's single-host writer lock needs no lease.

Revision ID: 0002
Revises: 0001
Create Date: 2025-01-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "quiesce_lease",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("holder", sa.String(256), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.Float(precision=53), nullable=False),
        sa.Column("writer_pid", sa.Integer(), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("quiesce_lease")
