"""The active coordinator's lease renewal (PostgreSQL standby takeover).

`keep_lease(ledger, interval_s)` runs as a background task of `Coordinator.open` for as long as
the coordinator is open. Every `interval_s` (a third of `lease_s`) it renews the lease through
`Ledger.renew_lease`. When a renewal finds that another coordinator took the lease (this one was
stopped or too slow for longer than `lease_s`), the ledger fences itself and the task ends: every
later append raises `FencedError`, so no further control call can be sent (calls are recorded
before they are sent). A database error is retried at the next tick; if it lasts longer than the
lease, a standby takes over, and the next renewal reports it.
"""

from __future__ import annotations

import anyio

from coordinator.errors import LedgerError
from ledger import Ledger

__all__ = ["keep_lease"]


async def keep_lease(ledger: Ledger, interval_s: float) -> None:
    """Renew `ledger`'s lease every `interval_s` until cancelled or until the lease is lost."""
    while True:
        await anyio.sleep(interval_s)
        try:
            if not await ledger.renew_lease():
                return
        except LedgerError:
            continue
