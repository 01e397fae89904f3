"""The active coordinator's lease renewal (PostgreSQL standby takeover).

`keep_lease(ledger, interval_s)` runs as a background task of `Coordinator.open` for as long as
the coordinator is open. Every `interval_s` (a third of `lease_s`) it renews the lease through
`Ledger.renew_lease`. When a renewal finds that another coordinator took the lease (this one was
stopped or too slow for longer than `lease_s`), the ledger fences itself and the task ends: every
later append raises `FencedError`, so no further control call can be sent (calls are recorded
before they are sent). A database error is retried at the next tick; if it lasts longer than the
lease, a standby takes over, and the next renewal reports it.

The lease row's holder names the process (`host/pid/uuid`) and, for a coordinator that serves
(`quiesce serve`), the address it serves at after one space: `holder_text` writes it and
`advertised_address` reads it back, so a standby can send callers to the active one.
"""

from __future__ import annotations

import anyio

from quiesce.coordinator.errors import LedgerError
from quiesce.ledger import Ledger

__all__ = ["advertised_address", "holder_text", "keep_lease"]


async def keep_lease(ledger: Ledger, interval_s: float) -> None:
    """Renew `ledger`'s lease every `interval_s` until cancelled or until the lease is lost."""
    while True:
        await anyio.sleep(interval_s)
        try:
            if not await ledger.renew_lease():
                return
        except LedgerError:
            continue


def holder_text(identity: dict[str, object], advertise: str | None = None) -> str:
    """The lease holder of the coordinator `identity` (host, pid, uuid), with the address it
    serves at, if any (no spaces allowed in it: the first space separates it)."""
    base = f"{identity['host']}/{identity['pid']}/{identity['uuid']}"
    return f"{base} {advertise}" if advertise else base


def advertised_address(holder: str) -> str | None:
    """The address a lease holder serves at (`holder_text`), or None when it serves none."""
    _, _, address = holder.partition(" ")
    return address or None
