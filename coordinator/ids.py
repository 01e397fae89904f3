"""Checkpoint ids: unique across ledgers, sortable within one, valid for Gym.

A Gym server remembers every checkpoint id it retired and answers 409 `stale_checkpoint` to it
forever, so an id must never repeat for the life of the servers — across ledgers too, not only
within one. The rule:

    q<ledger id>-<seq>-e<epoch>-w<writer>     e.g. q3f9a0c2e71-0000000042-e7-w5c01d2

- `<ledger id>`: the first 10 hex digits of the hash of the ledger's first event. That event is
  the first `coordinator.started` (its payload holds a random uuid, its hash covers its time), so
  the id is random, made once when the ledger is created, and never changes: the ledger is
  append-only. No schema change stores it; any process can read it back.
- `<seq>`: the seq the attempt's `attempt.started` gets (the single writer knows it), zero-padded
  to 10 digits, so ids of one ledger sort as their attempts started (`e10` never sorts before
  `e9`: the epoch comes after the seq, which alone orders them).
- `e<epoch>`: the writing coordinator's epoch, so a zombie's id is visibly another epoch's.
- `w<writer>`: the first 6 hex digits of the hash of this writer's own `coordinator.started`
  (random uuid, time). Two copies of one ledger — a backup restored beside its original — share
  the ledger id, and their writers can reach the same epoch and seq; this part still tells their
  ids apart, so a server that retired one copy's id never sees it again from the other.
- The leading `q` keeps every such id sorting after the `e<epoch>-<seq>` ids older versions
  wrote, so a ledger that has both still lists them in order.

Ids written before this rule (`e<epoch>-<seq>`, e.g. `e1-000013`, and `q<ledger id>-<seq>-e<epoch>`
without the writer part) stay valid wherever an id is parsed or shown (`epoch_of` reads them all).
Every id matches Gym's `^[A-Za-z0-9][A-Za-z0-9._-]*$` and is far below its 128 characters.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["LEGACY_ID", "NEW_ID", "checkpoint_id", "epoch_of", "ledger_id_of"]

#: Hex digits of the ledger id: 40 bits, so two ledgers of one cluster share one by chance only
#: once in about a million million pairs — and even then their seqs would have to meet too.
LEDGER_ID_DIGITS: Final = 10
SEQ_DIGITS: Final = 10
#: Hex digits of the writer part: 24 bits, against copies of one ledger that reach the same seq.
WRITER_DIGITS: Final = 6
NEW_ID: Final = re.compile(r"^q([0-9a-f]+)-(\d+)-e(\d+)(?:-w([0-9a-f]+))?$")
LEGACY_ID: Final = re.compile(r"^e(\d+)-(\d+)$")
_HASH: Final = re.compile(r"^[0-9a-f]{64}$")


def ledger_id_of(first_hash: str) -> str | None:
    """The ledger id taken from the hash of a ledger's first event (None if it is not a hash)."""
    return first_hash[:LEDGER_ID_DIGITS] if _HASH.match(first_hash) else None


def checkpoint_id(ledger_id: str | None, epoch: int, seq: int, epoch_hash: str = "") -> str:
    """The checkpoint id of the attempt whose `attempt.started` gets `seq`, made by the writer whose
    `coordinator.started` has hash `epoch_hash`.

    `ledger_id` None (a stand-in ledger that stores no events: the benchmarks' null ledger) gives
    the legacy `e<epoch>-<seq>`; every real ledger has a first event by the time an attempt starts,
    and every writer its `coordinator.started` (`ValueError` if `epoch_hash` is not a hash then).
    """
    if ledger_id is None:
        return f"e{epoch}-{seq:06d}"
    if not _HASH.match(epoch_hash):
        raise ValueError(f"no coordinator.started hash for this writer: {epoch_hash!r}")
    return f"q{ledger_id}-{seq:0{SEQ_DIGITS}d}-e{epoch}-w{epoch_hash[:WRITER_DIGITS]}"


def epoch_of(checkpoint_id: str) -> int | None:
    """The epoch an id was made by (either form), or None for an id quiesce did not make."""
    found = NEW_ID.match(checkpoint_id)
    if found:
        return int(found.group(3))
    legacy = LEGACY_ID.match(checkpoint_id)
    return int(legacy.group(1)) if legacy else None
