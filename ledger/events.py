"""The event vocabulary and the stored event record.

Writers are validated strictly (``extra="forbid"``; an unknown kind is refused by
``Ledger.append``). Readers never validate: ``Event.data`` is whatever was stored, so old
events stay readable when a payload model gains a field. New fields must be optional.

The payload models (one per kind, ``PAYLOADS``, ``Payload``) are defined in ``quiesce.ledger.payloads`` and
importable from here too (``from quiesce.ledger.events import CallSent``); they are loaded on first use, so
a reader — which needs only ``Event`` — never builds them.

Column rules checked on append (``COLUMN_RULES``): ``attempt.*`` and ``phase.*`` events name
their ``checkpoint_id``; ``call.*`` events carry the ``call_id`` that pairs a ``call.sent``
with its outcome.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    pass

#: The kinds of the vocabulary (the keys of ``PAYLOADS``); ``Ledger.append`` refuses any other.
KINDS: Final = frozenset(
    {
        "coordinator.started",
        "discovery.completed",
        "attempt.started",
        "phase.started",
        "call.sent",
        "call.replied",
        "call.failed",
        "phase.completed",
        "phase.failed",
        "attempt.publishing",
        "attempt.published",
        "attempt.aborting",
        "attempt.aborted",
        "attempt.completed",
        "recovery.started",
        "recovery.settled",
        "recovery.completed",
        "episodes.blocked",
        "episodes.scoped",
        "episodes.exported",
        "episodes.restored",
        "episodes.retired",
        "rollouts.forgotten",
        "rollouts.captured",
        "rollouts.acknowledged",
        "rollouts.continued",
    }
)


def __getattr__(name: str) -> Any:
    """Serve the payload models of ``quiesce.ledger.payloads`` (loaded on first use; readers need none)."""
    if not name.startswith("__"):
        payloads = importlib.import_module("quiesce.ledger.payloads")
        if name in payloads.__all__:
            return getattr(payloads, name)
    raise AttributeError(f"module 'quiesce.ledger.events' has no attribute {name!r}")


#: Which columns a kind requires on append: kind prefix -> column names.
COLUMN_RULES: Final[dict[str, tuple[str, ...]]] = {
    "attempt.": ("checkpoint_id",),
    "phase.": ("checkpoint_id",),
    "call.": ("call_id",),
}


@dataclass(frozen=True, slots=True)
class Event:
    """One stored row of ``events``. ``data`` is the stored payload (redacted, bodies capped).

    ``at`` is UTC ISO-8601 with microseconds and a ``Z`` suffix, e.g. ``2025-01-02T03:04:05.000006Z``.
    """

    seq: int
    at: str
    kind: str
    checkpoint_id: str | None
    server: str | None
    call_id: str | None
    epoch: int
    data: dict[str, Any]
    prev_hash: str
    hash: str

    def columns(self) -> dict[str, Any]:
        """The stored columns by name, in table order (``quiesce.ledger.layout.EVENT_COLUMNS``): what the
        service's streams and the audit bundle's lines show of an event."""
        return {
            "seq": self.seq,
            "at": self.at,
            "kind": self.kind,
            "checkpoint_id": self.checkpoint_id,
            "server": self.server,
            "call_id": self.call_id,
            "epoch": self.epoch,
            "data": self.data,
            "prev_hash": self.prev_hash,
            "hash": self.hash,
        }


_new_object = object.__new__
(_set_seq, _set_at, _set_kind, _set_cid, _set_server, _set_call_id, _set_epoch, _set_data, _set_prev,
 _set_hash) = (Event.__dict__[f.name].__set__ for f in fields(Event))  # fmt: skip


def new_event(
    seq: int,
    at: str,
    kind: str,
    checkpoint_id: str | None,
    server: str | None,
    call_id: str | None,
    epoch: int,
    data: dict[str, Any],
    prev_hash: str,
    hash: str,
) -> Event:
    """``Event(...)`` of the same values, built without the frozen ``__init__`` (which sets each
    field through ``object.__setattr__``): it sets the same slots, so the event is equal in every
    respect. The ledger builds every appended event through it (the append path)."""
    event = _new_object(Event)
    _set_seq(event, seq)
    _set_at(event, at)
    _set_kind(event, kind)
    _set_cid(event, checkpoint_id)
    _set_server(event, server)
    _set_call_id(event, call_id)
    _set_epoch(event, epoch)
    _set_data(event, data)
    _set_prev(event, prev_hash)
    _set_hash(event, hash)
    return event


@dataclass(frozen=True, slots=True)
class AppendItem:
    """One event of an ``append_many`` batch; the arguments of ``append``."""

    kind: str
    checkpoint_id: str | None = None
    server: str | None = None
    call_id: str | None = None
    data: Any = field(default_factory=dict)


__all__ = ["COLUMN_RULES", "KINDS", "AppendItem", "Event", "new_event"]


def event_from_raw(raw: Sequence[Any]) -> Event:
    """The ``Event`` of a stored events row (columns in ``quiesce.ledger.layout.EVENT_COLUMNS``
    order, ``data`` as JSON text; a payload that is not an object is kept as ``{"value": ...}``)."""
    seq, at, kind, cid, server, call_id, epoch, data, prev_hash, digest = raw
    parsed = json.loads(data)
    return Event(
        seq=int(seq),
        at=at,
        kind=kind,
        checkpoint_id=cid,
        server=server,
        call_id=call_id,
        epoch=int(epoch),
        data=parsed if isinstance(parsed, dict) else {"value": parsed},
        prev_hash=prev_hash,
        hash=digest,
    )
