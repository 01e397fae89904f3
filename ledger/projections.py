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
from dataclasses import dataclass
from typing import Any, Final

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


def replace(row: AttemptRow, **changes: Any) -> AttemptRow:
    """``row`` with ``changes`` applied (a faster ``dataclasses.replace``)."""
    values = {name: getattr(row, name) for name in COLUMNS}
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
    if kind == "call.sent":  # the most frequent event: built directly, no generic replace
        return AttemptRow(
            row.checkpoint_id, row.kind, row.state, row.outcome, row.started_at, row.ended_at,
            row.deadline_ts, row.participants, row.epoch, row.calls + 1, row.failures, row.recovered_by, seq,
        )  # fmt: skip
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
