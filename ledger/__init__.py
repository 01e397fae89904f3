"""quiesce's ledger: an append-only, hash-chained event store on SQLite or PostgreSQL.

The only package of quiesce that knows SQL; it imports nothing else of ours. See ``Ledger``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ledger.backend import LeaseState
    from ledger.canonical import GENESIS_HASH, chain_hash, row_bytes
    from ledger.errors import BrokenChainError, FencedError, LedgerError, QuiesceError
    from ledger.events import KINDS, PAYLOADS, AppendItem, Event, Payload
    from ledger.projections import AttemptRow, fold
    from ledger.redact import BODY_CAP_BYTES, REDACTED
    from ledger.replay import ReplayReport, replay_url
    from ledger.store import (
        AfterAppend,
        Durability,
        LeaseTerms,
        Ledger,
        downgrade_schema,
        event_from_raw,
        upgrade_schema,
        utc_now,
    )

#: Public names and the module each lives in, imported on first use: `ledger.errors` (which the
#: CLI imports at start for its error hierarchy) must not pull in SQLAlchemy, alembic and pydantic.
_EXPORTS: dict[str, str] = {
    "AfterAppend": "ledger.store",
    "AppendItem": "ledger.events",
    "AttemptRow": "ledger.projections",
    "BODY_CAP_BYTES": "ledger.redact",
    "BrokenChainError": "ledger.errors",
    "Durability": "ledger.store",
    "Event": "ledger.events",
    "FencedError": "ledger.errors",
    "GENESIS_HASH": "ledger.canonical",
    "KINDS": "ledger.events",
    "LeaseState": "ledger.backend",
    "LeaseTerms": "ledger.store",
    "Ledger": "ledger.store",
    "LedgerError": "ledger.errors",
    "PAYLOADS": "ledger.events",
    "Payload": "ledger.events",
    "QuiesceError": "ledger.errors",
    "REDACTED": "ledger.redact",
    "ReplayReport": "ledger.replay",
    "chain_hash": "ledger.canonical",
    "downgrade_schema": "ledger.store",
    "event_from_raw": "ledger.store",
    "fold": "ledger.projections",
    "replay_url": "ledger.replay",
    "row_bytes": "ledger.canonical",
    "upgrade_schema": "ledger.store",
    "utc_now": "ledger.store",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ledger' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "BODY_CAP_BYTES",
    "GENESIS_HASH",
    "KINDS",
    "PAYLOADS",
    "REDACTED",
    "AfterAppend",
    "AppendItem",
    "AttemptRow",
    "BrokenChainError",
    "Durability",
    "Event",
    "FencedError",
    "LeaseState",
    "LeaseTerms",
    "Ledger",
    "LedgerError",
    "Payload",
    "QuiesceError",
    "ReplayReport",
    "chain_hash",
    "downgrade_schema",
    "event_from_raw",
    "fold",
    "replay_url",
    "row_bytes",
    "upgrade_schema",
    "utc_now",
]
