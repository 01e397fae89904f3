"""The ``attempts`` projection: one row per checkpoint id, derived from ``events`` only.

``fold`` is the single definition of the projection. The writer applies it in the same
transaction as each event it appends; ``ledger.replay`` applies it to the whole stream to rebuild
the table. Both therefore agree by construction; ``replay --verify`` checks that they did.

Rules (``fold(row, event)``, for each checkpoint id in ``touched(event)``):

- ``attempt.started`` creates the row (state ``started``; kind, deadline, participants, epoch and
  ``started_at`` from the event). A repeated ``attempt.started`` only advances ``last_seq``.
- Any other event for an id without a row creates nothing (returns ``None``).
- While the attempt is not terminal: ``phase.started`` sets state to the phase name;
  ``attempt.publishing`` / ``attempt.published`` / ``attempt.aborting`` set that state;
  ``attempt.aborted`` is terminal (state and outcome ``aborted``); ``attempt.completed`` is terminal
  (state ``completed``, outcome from the payload: published, restored or resumed).
  A ``recovery.completed`` whose ``outcomes`` maps the id to ``abandoned`` makes it terminal with
  state and outcome ``abandoned`` (an interrupted restore). Terminal events set ``ended_at``.
- Always: ``call.sent`` counts in ``calls``, ``call.failed`` in ``failures``; ``recovery.settled``
  for the id, and ``recovery.completed`` naming it, set ``recovered_by`` to the event's epoch.
- ``last_seq`` is the seq of the last event that *changed* the row. A ``call.replied`` changes
  nothing (``touched`` returns no id for it), so a recorded call costs one projection write, not two;
  the attempt's last event of any kind is one indexed query away in ``events``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Final, TypeAlias

from ledger.canonical import canonical_text
from ledger.events import Event

TERMINAL_OUTCOMES: Final = frozenset({"aborted", "published", "restored", "resumed", "abandoned"})

#: The kinds whose payload ``fold`` reads. For any other kind ``fold`` ignores ``event.data``,
#: which lets replay skip decoding those payloads.
KINDS_READ_BY_FOLD: Final = frozenset(
    {"attempt.started", "phase.started", "attempt.completed", "recovery.completed"}
)

_STATE_OF: Final = {
    "attempt.publishing": "publishing",
    "attempt.published": "published",
    "attempt.aborting": "aborting",
}


COLUMNS: Final = (
    "checkpoint_id",
    "kind",
    "state",
    "outcome",
    "started_at",
    "ended_at",
    "deadline_ts",
    "participants",
    "epoch",
    "calls",
    "failures",
    "recovered_by",
    "last_seq",
)


@dataclass(frozen=True, slots=True)
class AttemptRow:
    """One row of ``attempts``. ``outcome`` is ``None`` until the attempt is terminal."""

    checkpoint_id: str
    kind: str
    state: str
    outcome: str | None
    started_at: str
    ended_at: str | None
    deadline_ts: float | None
    participants: tuple[str, ...]
    epoch: int
    calls: int
    failures: int
    recovered_by: int | None
    last_seq: int


_columns_of = attrgetter(*COLUMNS)


def replace(row: AttemptRow, **changes: Any) -> AttemptRow:
    """``row`` with ``changes`` applied (a faster ``dataclasses.replace``)."""
    values = dict(zip(COLUMNS, _columns_of(row), strict=True))
    values.update(changes)
    return AttemptRow(**values)


#: Kinds that never change a projection row (so appending them writes no projection row).
UNTOUCHING_KINDS: Final = frozenset({"call.replied"})


def touched(event: Event) -> tuple[str, ...]:
    """The checkpoint ids whose projection row ``event`` may change, in a fixed order."""
    kind = event.kind
    if kind in UNTOUCHING_KINDS:
        return ()
    if kind == "recovery.completed":
        outcomes = event.data.get("outcomes")
        ids = tuple(sorted(k for k in outcomes if isinstance(k, str))) if isinstance(outcomes, dict) else ()
        if event.checkpoint_id is not None and event.checkpoint_id not in ids:
            return (event.checkpoint_id, *ids)
        return ids
    return () if event.checkpoint_id is None else (event.checkpoint_id,)


#: The kind whose only effect is to count: ``fold`` of it is ``count_calls(row, 1, seq)``.
COUNTED_KIND: Final = "call.sent"


def count_calls(row: AttemptRow | None, n: int, last_seq: int) -> AttemptRow | None:
    """The row after ``n`` consecutive ``call.sent`` events for it, the last one at ``last_seq``.

    Equal to ``fold`` applied ``n`` times (the definition ``fold`` itself uses): ``calls`` grows by
    ``n`` and ``last_seq`` becomes ``last_seq`` whatever the state; no row stays no row.
    """
    if row is None:
        return None
    return AttemptRow(
        row.checkpoint_id, row.kind, row.state, row.outcome, row.started_at, row.ended_at,
        row.deadline_ts, row.participants, row.epoch, row.calls + n, row.failures, row.recovered_by, last_seq,
    )  # fmt: skip


def _started(event: Event, checkpoint_id: str) -> AttemptRow:
    data: dict[str, Any] = event.data
    deadline = data.get("deadline_ts")
    participants = data.get("participants")
    return AttemptRow(
        checkpoint_id=checkpoint_id,
        kind=str(data.get("kind", "")),
        state="started",
        outcome=None,
        started_at=event.at,
        ended_at=None,
        deadline_ts=float(deadline) if isinstance(deadline, int | float) else None,
        participants=tuple(str(p) for p in participants) if isinstance(participants, list) else (),
        epoch=event.epoch,
        calls=0,
        failures=0,
        recovered_by=None,
        last_seq=event.seq,
    )


def fold(row: AttemptRow | None, event: Event, checkpoint_id: str | None = None) -> AttemptRow | None:
    """The projection row after ``event``. Pure; never mutates its arguments.

    ``checkpoint_id`` names the row being folded when it differs from ``event.checkpoint_id``
    (``recovery.completed`` touches several); it defaults to ``event.checkpoint_id``.
    """
    cid = checkpoint_id if checkpoint_id is not None else event.checkpoint_id
    kind = event.kind
    if row is None:
        if kind == "attempt.started" and cid is not None:
            return _started(event, cid)
        return None
    seq = event.seq
    if kind == COUNTED_KIND:  # the most frequent event
        return count_calls(row, 1, seq)
    if kind == "call.failed":
        return replace(row, failures=row.failures + 1, last_seq=seq)
    if kind == "recovery.settled":
        return replace(row, recovered_by=event.epoch, last_seq=seq)
    if kind == "recovery.completed":
        outcomes = event.data.get("outcomes")
        outcome = outcomes.get(row.checkpoint_id) if isinstance(outcomes, dict) else None
        if outcome == "abandoned" and row.outcome is None:
            return replace(
                row,
                state="abandoned",
                outcome="abandoned",
                ended_at=event.at,
                recovered_by=event.epoch,
                last_seq=seq,
            )
        return replace(row, recovered_by=event.epoch, last_seq=seq)
    if row.outcome is not None:  # terminal: only counters and recovery marks change
        return replace(row, last_seq=seq)
    if kind == "phase.started":
        return replace(row, state=str(event.data.get("phase", "")), last_seq=seq)
    state = _STATE_OF.get(kind)
    if state is not None:
        return replace(row, state=state, last_seq=seq)
    if kind == "attempt.aborted":
        return replace(row, state="aborted", outcome="aborted", ended_at=event.at, last_seq=seq)
    if kind == "attempt.completed":
        outcome = event.data.get("outcome")
        return replace(
            row,
            state="completed",
            outcome=str(outcome) if outcome is not None else "completed",
            ended_at=event.at,
            last_seq=seq,
        )
    return replace(row, last_seq=seq)


#: What ``fold_items`` folds: a stored ``events`` row (10 columns, ``ledger.layout.EVENT_COLUMNS``
#: order), or ``(checkpoint_id, n, last_seq)`` standing for ``n`` consecutive ``call.sent`` events of
#: that id (``count_calls``). Plain tuples: they cross process boundaries cheaply.
FoldItem: TypeAlias = tuple[Any, ...]


class FoldFeed:
    """Reduces stored ``events`` rows, added in seq order, to the items ``fold_items`` folds.

    Folding the items gives the rows that ``fold`` over every event gives, because for each
    checkpoint id the items keep the order of the events touching it, and a run of its
    ``call.sent`` events with no other event touching that id in between becomes one count: an
    event for an id first flushes that id's pending count, and ``recovery.completed`` (which may
    touch any id) flushes all of them. Rows touching no id (``touched`` is empty) are dropped.
    """

    __slots__ = ("_counts", "items")

    def __init__(self) -> None:
        self.items: list[FoldItem] = []
        self._counts: dict[str, list[int]] = {}

    def add(self, rows: Iterable[Sequence[Any]]) -> None:
        """Take stored rows (columns in ``ledger.layout.EVENT_COLUMNS`` order) following those added."""
        counts = self._counts
        items = self.items
        counted, untouching = COUNTED_KIND, UNTOUCHING_KINDS
        for row in rows:
            kind = row[2]
            if kind == counted:
                cid = row[3]
                if cid is not None:
                    pending = counts.get(cid)
                    if pending is None:
                        counts[cid] = [1, row[0]]
                    else:
                        pending[0] += 1
                        pending[1] = row[0]
            elif kind not in untouching:
                cid = row[3]
                if kind == "recovery.completed":
                    self.flush()
                elif cid is None:
                    continue
                else:
                    pending = counts.pop(cid, None)
                    if pending is not None:
                        items.append((cid, pending[0], pending[1]))
                items.append(tuple(row))

    def flush(self) -> None:
        """Turn every pending count into an item."""
        self.items.extend((cid, n, last) for cid, (n, last) in self._counts.items())
        self._counts.clear()

    def take(self) -> list[FoldItem]:
        """The items so far (pending counts flushed); the feed starts empty again."""
        self.flush()
        items, self.items = self.items, []
        return items


def _event(row: Sequence[Any]) -> Event:
    seq, at, kind, cid, server, call_id, epoch, data_text, prev_hash, digest = row
    data: dict[str, Any] = {}
    if kind in KINDS_READ_BY_FOLD:
        try:
            parsed = json.loads(data_text)
        except (ValueError, TypeError):
            parsed = {}
        data = parsed if isinstance(parsed, dict) else {}
    return Event(seq, at, kind, cid, server, call_id, epoch, data, prev_hash, digest)


def fold_items(rows: dict[str, AttemptRow], items: Iterable[FoldItem]) -> None:
    """Fold ``items`` (from ``FoldFeed``, in order) into ``rows`` (checkpoint id -> row), in place.

    Only the payloads ``fold`` reads (``KINDS_READ_BY_FOLD``) are decoded.
    """
    for item in items:
        if len(item) == 3:
            cid, n, last_seq = item
            counted = count_calls(rows.get(cid), n, last_seq)
            if counted is not None:
                rows[cid] = counted
            continue
        event = _event(item)
        for touched_id in touched(event):
            new = fold(rows.get(touched_id), event, touched_id)
            if new is not None:
                rows[touched_id] = new


_participants_cache: dict[tuple[str, ...], str] = {}


def _participants_text(participants: tuple[str, ...]) -> str:
    text = _participants_cache.get(participants)
    if text is None:
        if len(_participants_cache) > 256:
            _participants_cache.clear()
        text = _participants_cache[participants] = canonical_text(list(participants))
    return text


def to_columns(row: AttemptRow) -> dict[str, Any]:
    """The row as stored: ``participants`` becomes canonical JSON text."""
    return {
        "checkpoint_id": row.checkpoint_id,
        "kind": row.kind,
        "state": row.state,
        "outcome": row.outcome,
        "started_at": row.started_at,
        "ended_at": row.ended_at,
        "deadline_ts": row.deadline_ts,
        "participants": _participants_text(row.participants),
        "epoch": row.epoch,
        "calls": row.calls,
        "failures": row.failures,
        "recovered_by": row.recovered_by,
        "last_seq": row.last_seq,
    }


_parsed_cache: dict[str, tuple[str, ...]] = {}


def _participants_tuple(text: str | None) -> tuple[str, ...]:
    """Stored participants text → names; memoised, as attempts of one cluster share one list."""
    if not text:
        return ()
    names = _parsed_cache.get(text)
    if names is None:
        parsed = json.loads(text)
        names = tuple(str(p) for p in parsed) if isinstance(parsed, list) else ()
        if len(_parsed_cache) > 256:
            _parsed_cache.clear()
        _parsed_cache[text] = names
    return names


def from_columns(values: tuple[Any, ...] | list[Any]) -> AttemptRow:
    """An ``AttemptRow`` from stored column values in ``COLUMNS`` order."""
    (cid, kind, state, outcome, started_at, ended_at, deadline, participants, epoch, calls, failures,
     recovered_by, last_seq) = values  # fmt: skip
    return AttemptRow(
        checkpoint_id=cid,
        kind=kind,
        state=state,
        outcome=outcome,
        started_at=started_at,
        ended_at=ended_at,
        deadline_ts=float(deadline) if deadline is not None else None,
        participants=_participants_tuple(participants),
        epoch=int(epoch),
        calls=int(calls),
        failures=int(failures),
        recovered_by=int(recovered_by) if recovered_by is not None else None,
        last_seq=int(last_seq),
    )
