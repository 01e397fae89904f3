"""quiesce's ledger: an append-only, hash-chained event store on SQLite or PostgreSQL.

The only package of quiesce that knows SQL; it imports nothing else of ours. See ``Ledger``.
"""

from __future__ import annotations

from ledger.backend import LeaseState
from ledger.canonical import GENESIS_HASH, canonical, chain_hash, row_bytes
from ledger.errors import FencedError, LedgerError, QuiesceError
from ledger.events import KINDS, PAYLOADS, AppendItem, Event, Payload
from ledger.projections import AttemptRow, fold
from ledger.redact import BODY_CAP_BYTES, REDACTED
from ledger.replay import ReplayReport, replay
from ledger.store import (
    AfterAppend,
    Durability,
    LeaseTerms,
    Ledger,
    downgrade_schema,
    upgrade_schema,
    utc_now,
)

__all__ = [
    "BODY_CAP_BYTES",
    "GENESIS_HASH",
    "KINDS",
    "PAYLOADS",
    "REDACTED",
    "AfterAppend",
    "AppendItem",
    "AttemptRow",
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
    "canonical",
    "chain_hash",
    "downgrade_schema",
    "fold",
    "replay",
    "row_bytes",
    "upgrade_schema",
    "utc_now",
]
