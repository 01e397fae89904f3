"""The ``attempts`` projection: one row per checkpoint id, derived from ``events`` only.

``fold`` is the single definition of the projection. The writer applies it in the same
transaction as each event it appends; ``quiesce.ledger.replay`` applies it to the whole stream to rebuild
the table. Both therefore agree by construction; ``replay --verify`` checks that they did. Replay
calls the same rules without building an ``Event``: ``fold_columns``/``touched_by`` take only the
columns they read, and ``FoldFeed`` keeps only those (``FoldItem``).

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
- Always: ``call.failed`` counts in ``failures``; ``recovery.settled`` for the id, and
  ``recovery.completed`` naming it, set ``recovered_by`` to the event's epoch.
- ``call.sent`` changes no row by itself: it is counted in ``calls`` by the next event that
  touches its attempt's row (``fold``'s ``sent``). A recorded call therefore writes no projection
  row at all (``call.replied`` never touches one either): its append is the events row and its
  index entry only. ``calls`` counts the ``call.sent`` events of the attempt up to ``last_seq``; the
  live count adds those after it (``Ledger.attempts`` does, one indexed range per row), so a
  reader sees every call made, and a row folded here equals the stored one whatever call came
  last. A ``call.sent`` before its attempt's ``attempt.started`` is never counted.
- ``last_seq`` is the seq of the last event that touched the row (``touched``); neither
  ``call.sent`` nor ``call.replied`` does. The attempt's last event of any kind is one indexed
  query away in ``events``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Final, TypeAlias

from quiesce.ledger.canonical import canonical_text
from quiesce.ledger.events import Event

TERMINAL_OUTCOMES: Final = frozenset({"aborted", "published", "restored", "resumed", "abandoned"})

#: The kinds whose payload ``fold`` (and ``touched``) reads, each with the only keys read, always
#: as ``data.get(key)``. For any other kind ``fold`` ignores ``event.data``, which lets replay skip
#: decoding those payloads, and keeping just these keys of the others changes no result
#: (``payload_read_by_fold``).
KEYS_READ_BY_FOLD: Final[dict[str, tuple[str, ...]]] = {
    "attempt.started": ("kind", "deadline_ts", "participants"),
    "phase.started": ("phase",),
    "attempt.completed": ("outcome",),
    "recovery.completed": ("outcomes",),
}
KINDS_READ_BY_FOLD: Final = frozenset(KEYS_READ_BY_FOLD)

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
_new = object.__new__
(_set_cid, _set_kind, _set_state, _set_outcome, _set_started, _set_ended, _set_deadline, _set_participants,
 _set_epoch, _set_calls, _set_failures, _set_recovered, _set_last) = (
    AttemptRow.__dict__[name].__set__ for name in COLUMNS
)  # fmt: skip


def _row(
    checkpoint_id: str,
    kind: str,
    state: str,
    outcome: str | None,
    started_at: str,
    ended_at: str | None,
    deadline_ts: float | None,
    participants: tuple[str, ...],
    epoch: int,
    calls: int,
    failures: int,
    recovered_by: int | None,
    last_seq: int,
) -> AttemptRow:
    """``AttemptRow(...)`` of the same values, built without the frozen ``__init__`` (which sets each
    field through ``object.__setattr__``): it sets the same slots, so the row is equal in every
    respect, at less than half the cost. ``fold`` builds every row through it."""
    row = _new(AttemptRow)
    _set_cid(row, checkpoint_id)
    _set_kind(row, kind)
    _set_state(row, state)
    _set_outcome(row, outcome)
    _set_started(row, started_at)
    _set_ended(row, ended_at)
    _set_deadline(row, deadline_ts)
    _set_participants(row, participants)
    _set_epoch(row, epoch)
    _set_calls(row, calls)
    _set_failures(row, failures)
    _set_recovered(row, recovered_by)
    _set_last(row, last_seq)
    return row


_COLUMN_SET: Final = frozenset(COLUMNS)


def replace(row: AttemptRow, **changes: Any) -> AttemptRow:
    """``row`` with ``changes`` applied (``dataclasses.replace``; ``TypeError`` for a name that is no
    column). ``fold`` does not use it: it builds each row positionally (``_row``)."""
    unknown = changes.keys() - _COLUMN_SET
    if unknown:
        raise TypeError(f"AttemptRow has no column {sorted(unknown)[0]!r}")
    get = changes.get
    return _row(*[get(name, value) for name, value in zip(COLUMNS, _columns_of(row), strict=True)])


#: The kind counted, not folded: the next event touching its row adds it to ``calls`` (``fold``'s ``sent``).
COUNTED_KIND: Final = "call.sent"

#: Kinds that never change a projection row (so appending them writes no projection row).
UNTOUCHING_KINDS: Final = frozenset({"call.replied", COUNTED_KIND})


def touched(event: Event) -> tuple[str, ...]:
    """The checkpoint ids whose projection row ``event`` may change, in a fixed order."""
    return touched_by(event.kind, event.checkpoint_id, event.data)


def touched_by(kind: str, checkpoint_id: str | None, data: dict[str, Any]) -> tuple[str, ...]:
    """``touched`` of an event given by the columns it reads."""
    if kind in UNTOUCHING_KINDS:
        return ()
    if kind == "recovery.completed":
        outcomes = data.get("outcomes")
        ids = tuple(sorted(k for k in outcomes if isinstance(k, str))) if isinstance(outcomes, dict) else ()
        if checkpoint_id is not None and checkpoint_id not in ids:
            return (checkpoint_id, *ids)
        return ids
    return () if checkpoint_id is None else (checkpoint_id,)


def fold(
    row: AttemptRow | None, event: Event, checkpoint_id: str | None = None, sent: int = 0
) -> AttemptRow | None:
    """The projection row after ``event``, for an id ``touched(event)`` returns. Pure; never
    mutates its arguments.

    ``checkpoint_id`` names the row being folded when it differs from ``event.checkpoint_id``
    (``recovery.completed`` touches several); it defaults to ``event.checkpoint_id``. ``sent`` is
    the number of ``call.sent`` events of that id since the row's ``last_seq`` (since the start, for
    no row): this event counts them. ``fold_events`` is the whole definition over a stream.
    """
    cid = checkpoint_id if checkpoint_id is not None else event.checkpoint_id
    return fold_columns(row, cid, event.seq, event.at, event.kind, event.epoch, event.data, sent)


def fold_events(events: Iterable[Event]) -> dict[str, AttemptRow]:
    """The ``attempts`` rows of a stream of events in seq order: the projection's definition, which
    the writer's appends, replay (``FoldFeed``/``fold_items``) and migrations all keep."""
    rows: dict[str, AttemptRow] = {}
    sent: dict[str, int] = {}
    for event in events:
        if event.kind == COUNTED_KIND:
            if event.checkpoint_id is not None:
                sent[event.checkpoint_id] = sent.get(event.checkpoint_id, 0) + 1
            continue
        for cid in touched(event):
            new = fold(rows.get(cid), event, cid, sent.pop(cid, 0))
            if new is not None:
                rows[cid] = new
    return rows


def fold_columns(
    row: AttemptRow | None,
    checkpoint_id: str | None,
    seq: int,
    at: str,
    kind: str,
    epoch: int,
    data: dict[str, Any],
    sent: int = 0,
) -> AttemptRow | None:
    """``fold`` of an event given by the only columns it reads (the rules; see the module docstring).

    ``data`` is read only for ``KINDS_READ_BY_FOLD``, and only at their ``KEYS_READ_BY_FOLD``.
    """
    if row is None:
        if kind == "attempt.started" and checkpoint_id is not None:
            deadline = data.get("deadline_ts")
            participants = data.get("participants")
            return _row(
                checkpoint_id,
                str(data.get("kind", "")),
                "started",
                None,
                at,
                None,
                float(deadline) if isinstance(deadline, int | float) else None,
                tuple(str(p) for p in participants) if isinstance(participants, list) else (),
                epoch,
                0,
                0,
                None,
                seq,
            )
        return None
    if kind in UNTOUCHING_KINDS:  # touches no row (``touched``): the row as it is
        return row
    # The columns an event can change; every other one is carried over.
    state, outcome, ended_at, failures, recovered_by = (
        row.state, row.outcome, row.ended_at, row.failures, row.recovered_by
    )  # fmt: skip
    if kind == "call.failed":
        failures += 1
    elif kind == "recovery.settled":
        recovered_by = epoch
    elif kind == "recovery.completed":
        outcomes = data.get("outcomes")
        named = outcomes.get(row.checkpoint_id) if isinstance(outcomes, dict) else None
        if named == "abandoned" and outcome is None:
            state = outcome = "abandoned"
            ended_at = at
        recovered_by = epoch
    elif outcome is not None:  # terminal: only counters and recovery marks change
        pass
    elif kind == "phase.started":
        state = str(data.get("phase", ""))
    elif kind in _STATE_OF:
        state = _STATE_OF[kind]
    elif kind == "attempt.aborted":
        state = outcome = "aborted"
        ended_at = at
    elif kind == "attempt.completed":
        completed = data.get("outcome")
        state = "completed"
        outcome = str(completed) if completed is not None else "completed"
        ended_at = at
    return _row(
        row.checkpoint_id, row.kind, state, outcome, row.started_at, ended_at, row.deadline_ts,
        row.participants, row.epoch, row.calls + sent, failures, recovered_by, seq,
    )  # fmt: skip


#: What ``fold_items`` folds, as made by ``FoldFeed``: ``(seq, at, kind, checkpoint_id, epoch,
#: payload)`` for one event (``payload``: ``payload_read_by_fold`` of its stored data text), or
#: ``(checkpoint_id, n)`` standing for ``n`` consecutive ``call.sent`` events of that id (counted by
#: the next item touching the id: ``fold``'s ``sent``). Plain tuples of the columns ``fold`` reads
#: and no others: they cross process boundaries cheaply.
FoldItem: TypeAlias = tuple[Any, ...]

_NO_PAYLOAD: Final[dict[str, Any]] = {}  # read by nobody: fold reads no payload of those kinds


def payload_read_by_fold(kind: str, data_text: Any) -> dict[str, Any] | None:
    """What ``fold`` reads of a stored payload text: None for a kind whose payload it does not read;
    for ``KINDS_READ_BY_FOLD``, the decoded object's entries at ``KEYS_READ_BY_FOLD`` (``{}`` when the
    text is no JSON object). ``fold`` gives the same row for this as for the whole decoded payload."""
    keys = KEYS_READ_BY_FOLD.get(kind)
    if keys is None:
        return None
    try:
        parsed = json.loads(data_text)
    except (ValueError, TypeError):
        return {}
    if not isinstance(parsed, dict):
        return {}
    return {key: parsed[key] for key in keys if key in parsed}


class FoldFeed:
    """Reduces stored ``events`` rows, added in seq order, to the items ``fold_items`` folds.

    Folding the items gives the rows that ``fold`` over every event gives, because for each
    checkpoint id the items keep the order of the events touching it, and a run of its
    ``call.sent`` events with no other event touching that id in between becomes one count: an
    event for an id first flushes that id's pending count, and ``recovery.completed`` (which may
    touch any id) flushes all of them. Rows touching no id (``touched`` is empty) are dropped. An
    event's item keeps only what ``fold`` and ``touched`` read of it (``FoldItem``): its payload is
    decoded here, once, so a replay worker (``quiesce.ledger.replay_worker``) does it in parallel.
    """

    __slots__ = ("_counts", "items")

    def __init__(self) -> None:
        self.items: list[FoldItem] = []
        self._counts: dict[str, int] = {}

    def add(self, rows: Iterable[Sequence[Any]]) -> None:
        """Take stored rows (in ``quiesce.ledger.layout.EVENT_COLUMNS`` order) following those added."""
        counts = self._counts
        items = self.items
        counted, untouching, read = COUNTED_KIND, UNTOUCHING_KINDS, KINDS_READ_BY_FOLD
        for row in rows:
            kind = row[2]
            if kind == counted:
                cid = row[3]
                if cid is not None:
                    counts[cid] = counts.get(cid, 0) + 1
            elif kind not in untouching:
                cid = row[3]
                if kind == "recovery.completed":
                    self.flush()
                elif cid is None:
                    continue
                else:
                    pending = counts.pop(cid, None)
                    if pending is not None:
                        items.append((cid, pending))
                payload = payload_read_by_fold(kind, row[7]) if kind in read else None
                items.append((row[0], row[1], kind, cid, row[6], payload))

    def flush(self) -> None:
        """Turn every pending count into an item."""
        self.items.extend(self._counts.items())
        self._counts.clear()

    def take(self) -> list[FoldItem]:
        """The items so far (pending counts flushed); the feed starts empty again."""
        self.flush()
        items, self.items = self.items, []
        return items


def fold_items(rows: dict[str, AttemptRow], items: Iterable[FoldItem], sent: dict[str, int]) -> None:
    """Fold ``items`` (from ``FoldFeed``, in order) into ``rows`` (checkpoint id -> row), in place.

    ``sent`` holds, per id, the ``call.sent`` events not yet counted by a touching event: kept by
    the caller from one call to the next (a stream folded in parts folds as a whole); what is
    left in it at the end is what no stored row counts yet."""
    get = rows.get
    for item in items:
        if len(item) == 2:
            cid, n = item
            sent[cid] = sent.get(cid, 0) + n
            continue
        seq, at, kind, cid, epoch, payload = item
        data = _NO_PAYLOAD if payload is None else payload
        for touched_id in touched_by(kind, cid, data):
            count = sent.pop(touched_id, 0) if sent else 0
            new = fold_columns(get(touched_id), touched_id, seq, at, kind, epoch, data, count)
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


_PARTICIPANTS_AT: Final = COLUMNS.index("participants")


def stored_values(row: AttemptRow) -> tuple[Any, ...]:
    """The row as stored, in ``COLUMNS`` order: ``participants`` becomes canonical JSON text."""
    values = _columns_of(row)
    at = _PARTICIPANTS_AT
    return (*values[:at], _participants_text(row.participants), *values[at + 1 :])


def to_columns(row: AttemptRow) -> dict[str, Any]:
    """``stored_values(row)`` by column name."""
    return dict(zip(COLUMNS, stored_values(row), strict=True))


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
