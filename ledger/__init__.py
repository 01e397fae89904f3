"""quiesce's ledger: an append-only, hash-chained event store on SQLite or PostgreSQL.

The only package of quiesce that knows SQL; it imports nothing else of ours. See ``Ledger``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quiesce.ledger.backend import LeaseState
    from quiesce.ledger.canonical import GENESIS_HASH, chain_hash, row_bytes
    from quiesce.ledger.errors import BrokenChainError, FencedError, LedgerError, LedgerUrlError, QuiesceError
    from quiesce.ledger.events import KINDS, PAYLOADS, AppendItem, Event, Payload, event_from_raw
    from quiesce.ledger.projections import AttemptRow, fold, fold_events
    from quiesce.ledger.redact import BODY_CAP_BYTES, REDACTED
    from quiesce.ledger.replay import ReplayReport, replay_url
    from quiesce.ledger.store import (
        AfterAppend,
        Durability,
        LeaseTerms,
        Ledger,
        downgrade_schema,
        restore_triggers,
        upgrade_schema,
        utc_now,
    )

#: Public names and the module each lives in, imported on first use: `quiesce.ledger.errors` (which the
#: CLI imports at start for its error hierarchy) must not pull in SQLAlchemy, alembic and pydantic.
_EXPORTS: dict[str, str] = {
    "AfterAppend": "quiesce.ledger.store",
    "AppendItem": "quiesce.ledger.events",
    "AttemptRow": "quiesce.ledger.projections",
    "BODY_CAP_BYTES": "quiesce.ledger.redact",
    "BrokenChainError": "quiesce.ledger.errors",
    "Durability": "quiesce.ledger.store",
    "Event": "quiesce.ledger.events",
    "FencedError": "quiesce.ledger.errors",
    "GENESIS_HASH": "quiesce.ledger.canonical",
    "KINDS": "quiesce.ledger.events",
    "LeaseState": "quiesce.ledger.backend",
    "LeaseTerms": "quiesce.ledger.store",
    "Ledger": "quiesce.ledger.store",
    "LedgerError": "quiesce.ledger.errors",
    "LedgerUrlError": "quiesce.ledger.errors",
    "PAYLOADS": "quiesce.ledger.events",
    "Payload": "quiesce.ledger.events",
    "QuiesceError": "quiesce.ledger.errors",
    "REDACTED": "quiesce.ledger.redact",
    "ReplayReport": "quiesce.ledger.replay",
    "chain_hash": "quiesce.ledger.canonical",
    "downgrade_schema": "quiesce.ledger.store",
    "event_from_raw": "quiesce.ledger.events",
    "fold": "quiesce.ledger.projections",
    "fold_events": "quiesce.ledger.projections",
    "replay_url": "quiesce.ledger.replay",
    "restore_triggers": "quiesce.ledger.store",
    "row_bytes": "quiesce.ledger.canonical",
    "upgrade_schema": "quiesce.ledger.store",
    "utc_now": "quiesce.ledger.store",
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
    "LedgerUrlError",
    "Payload",
    "QuiesceError",
    "ReplayReport",
    "chain_hash",
    "downgrade_schema",
    "event_from_raw",
    "fold",
    "fold_events",
    "replay_url",
    "restore_triggers",
    "row_bytes",
    "upgrade_schema",
    "utc_now",
]
