"""Which rollouts each lineage event names — the ``rollout_refs`` projection — and one rollout's
lineage read from it (``read_rollout_lineage``), without reading the whole ledger.

**The projection** (revision 0006): one row ``(rollout_id, seq)`` for every rollout id a lineage
event at ``seq`` names (``rollout_ids``: what ``quiesce.ledger.lineage`` reads of each kind, and
nothing else). It is written in the transaction that appends the event
(``quiesce.ledger.backend.apply_append``), backfilled by the migration for events appended
before it, rebuilt and compared by ``quiesce replay`` (``RefsDigest``), and derived from
``events`` only: ``rollout_refs`` = ``{(r, e.seq) for e in events if e.kind in REF_KINDS for r
in rollout_ids(e.kind, e.data)}``.

**One rollout's lineage** (``read_rollout_lineage``): ``LineageFold(steps=True, only=ids)`` fed, in
seq order, only the events that can change those rollouts' records; the result for each of them
equals the whole ledger's fold (state, attempt, steps, violations, warnings). Those events:

- every event that names one of them (the projection's seqs);
- for each checkpoint those events belong to, its ``attempt.started``, ``attempt.published``,
  ``attempt.aborted`` and inventory events, ``episodes.scoped`` and ``rollouts.captured`` (a later
  scope replaces an earlier one; a save published without its inventory recorded is passed over);
- the events that change a rollout without naming it. A rollout is live after a save captured it
  or a restore continued it; the first published save after that which does not capture it ends
  it (``finished`` or ``lost``), the first restore continuation (``episodes.restored``,
  ``rollouts.continued``) restarts it and clears its retire mark. So after each *anchor* (an event
  naming it, or the publication of a checkpoint that does) the first effective publication of a
  save (with its checkpoint's start, end and inventory events; one the fold passes over does not
  count: the next one does) and the first continuation before the next anchor; once both have
  passed, the rollout is neither live nor marked and no event that does not name it changes it
  until the next anchor;
- the ``discovery.completed`` events that tell the kind and features of the servers a publication
  or continuation of theirs depends on: walking back from the last one before that event until
  each of its servers is listed (the fold keeps each server's latest discovery).

Feeding any further real event never changes those rollouts' records (its effect on them is
what the whole fold gives it), so anchors shared by several rollouts may be read once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, Protocol

from quiesce.ledger.events import Event
from quiesce.ledger.lineage import (
    LINEAGE_KINDS,
    LineageFold,
    LineageReport,
    as_list,
    episode_of_capture_key,
    read_lineage,
    rollout_pairs,
)

__all__ = [
    "REF_KINDS",
    "RefsDigest",
    "read_rollout_lineage",
    "refs_of_rows",
    "rollout_ids",
]

#: The lineage kinds that name rollouts (every ``episodes.*`` and ``rollouts.*`` one the fold reads):
#: the only kinds with rows in ``rollout_refs``.
REF_KINDS: Final = frozenset(k for k in LINEAGE_KINDS if k.startswith(("episodes.", "rollouts.")))
#: Restore continuations: they restart every live rollout they do not continue, and clear marks.
CONTINUATION_KINDS: Final = ("episodes.restored", "rollouts.continued")
#: A save's start and end events and its inventory (the fold passes over a publication without one).
_SAVE_KINDS: Final = (
    "attempt.started",
    "attempt.published",
    "attempt.aborted",
    "episodes.scoped",
    "episodes.exported",
    "rollouts.captured",
)
_DISCOVERY: Final = "discovery.completed"


def _keys(groups: Any) -> Iterator[Any]:
    """The capture keys of ``{server: [key, ...]}``."""
    if isinstance(groups, Mapping):
        for keys in groups.values():
            yield from as_list(keys)


def _pair_ids(groups: Any) -> Iterator[str]:
    """The rollout ids of ``{agent: [{"rollout_id", "attempt"}, ...]}`` (v1 pairs, as the fold
    reads them: a str id and an int attempt, else skipped)."""
    if isinstance(groups, Mapping):
        for pairs in groups.values():
            yield from _pairs(pairs)


def _pairs(pairs: Any) -> Iterator[str]:
    return (rollout_id for rollout_id, _ in rollout_pairs(pairs))


def _mentions(kind: str, data: Mapping[str, Any]) -> Iterator[str]:
    """Every rollout id an event of ``kind`` names, as ``quiesce.ledger.lineage`` parses that kind
    (repeats included): one parser per kind."""
    if kind == "episodes.scoped":
        keys: Iterable[Any] = as_list(data.get("scope"))
        yield from (episode_of_capture_key(str(k))[0] for k in keys)
        yield from (episode_of_capture_key(str(k))[0] for k in _keys(data.get("restarts")))
    elif kind == "episodes.exported":
        yield from (episode_of_capture_key(str(k))[0] for k in _keys(data.get("exported")))
    elif kind == "episodes.restored":
        yield from (episode_of_capture_key(str(k))[0] for k in _keys(data.get("restored")))
    elif kind == "episodes.retired":
        yield from (episode_of_capture_key(str(k))[0] for k in as_list(data.get("episodes")))
    elif kind == "rollouts.forgotten":
        yield from (str(r) for r in as_list(data.get("rollout_ids")))
    elif kind == "rollouts.captured":
        yield from _pair_ids(data.get("captured"))
    elif kind == "rollouts.acknowledged":
        yield from _pairs(data.get("executions"))
    elif kind == "rollouts.continued":
        yield from _pair_ids(data.get("continued"))
        yield from _pair_ids(data.get("discarded"))


def rollout_ids(kind: str, data: Mapping[str, Any]) -> list[str]:
    """The distinct rollout ids an event of ``kind`` with payload ``data`` names, sorted (none for
    a kind outside ``REF_KINDS``): exactly the rollouts whose lineage records the event can change
    by naming them."""
    if kind not in REF_KINDS:
        return []
    return sorted(set(_mentions(kind, data)))


def refs_of_rows(rows: Iterable[tuple[Any, str, Any]]) -> Iterator[tuple[str, int]]:
    """``(rollout_id, seq)`` of every stored event given as ``(seq, kind, payload text)`` — the
    projection's rows for them, in the order given. A row of another kind costs one membership test;
    a payload that is no JSON object names nothing (``Event.data`` would hold no key the fold reads)."""
    import json

    kinds = REF_KINDS
    for seq, kind, text in rows:
        if kind in kinds:
            try:
                data = json.loads(text)
            except (TypeError, ValueError):
                continue
            if isinstance(data, dict):
                for rollout_id in rollout_ids(kind, data):
                    yield rollout_id, int(seq)


class RefsDigest:
    """An order-free summary of a set of ``(rollout_id, seq)`` rows, per bucket of ``BUCKET`` seqs:
    the row count and the sum of the rows' hashes (mod 2**64). Two sets with equal digests are equal
    but for a collision of Python's (per-process salted) hash; a bucket whose digests differ holds
    every difference, which ``quiesce.ledger.replay`` then lists row by row. Memory: two integers
    per bucket, whatever the number of rows."""

    BUCKET: Final = 65_536
    _MASK: Final = (1 << 64) - 1

    __slots__ = ("buckets", "upto")

    def __init__(self, upto: int | None = None) -> None:
        self.buckets: dict[int, list[int]] = {}
        #: rows with a larger seq are left out (None: none is)
        self.upto = upto

    def add(self, rows: Iterable[tuple[str, int]]) -> None:
        buckets, upto, size, mask = self.buckets, self.upto, self.BUCKET, self._MASK
        for rollout_id, seq in rows:
            if upto is not None and seq > upto:
                continue
            bucket = buckets.get(seq // size)
            if bucket is None:
                bucket = buckets[seq // size] = [0, 0]
            bucket[0] += 1
            bucket[1] = (bucket[1] + hash((rollout_id, seq))) & mask

    def differing(self, other: RefsDigest) -> list[tuple[int, int]]:
        """The seq ranges ``(lo, hi)`` (inclusive) of the buckets where ``self`` and ``other`` differ."""
        size = self.BUCKET
        keys = sorted(self.buckets.keys() | other.buckets.keys())
        return [
            (key * size, key * size + size - 1)
            for key in keys
            if self.buckets.get(key, [0, 0]) != other.buckets.get(key, [0, 0])
        ]


class _Reads(Protocol):
    """What ``read_rollout_lineage`` reads of a ``quiesce.ledger.Ledger``."""

    async def rollout_ref_seqs(self, rollout_ids: Sequence[str]) -> list[int]: ...
    async def events_at(self, seqs: Sequence[int]) -> list[Event]: ...
    async def checkpoint_events(self, checkpoint_ids: Sequence[str], kinds: Sequence[str]) -> list[Event]: ...
    async def first_in_ranges(
        self, kinds: Sequence[str], ranges: Sequence[tuple[int, int | None]]
    ) -> list[int | None]: ...
    async def last_before_each(self, kind: str, seqs: Sequence[int]) -> list[int | None]: ...


def _effective(seq: int, events: list[Event]) -> bool:
    """Whether the ``attempt.published`` at ``seq`` ends a save the fold holds open with its
    inventory recorded (its ``_saves`` and ``_Save.known``): a save's ``attempt.started`` came before
    it, then its ``episodes.scoped`` and after it its ``episodes.exported`` (v2), or its
    ``rollouts.captured`` (v1), and no publication or abort since (``events``: that checkpoint's
    ``_SAVE_KINDS`` events, in seq order)."""
    held = scoped = known = False
    for event in events:
        if event.seq >= seq:
            break
        kind = event.kind
        if kind == "attempt.started":
            if event.data.get("kind") == "save":
                held, scoped, known = True, False, False
        elif kind == "episodes.scoped":
            scoped = scoped or held
        elif kind == "episodes.exported":
            known = known or (scoped and isinstance(event.data.get("exported"), Mapping))
        elif kind == "rollouts.captured" and isinstance(event.data.get("captured"), Mapping):
            known = known or held
        else:
            held = scoped = known = False
    return held and known


async def read_rollout_lineage(ledger: _Reads, rollout_ids: Iterable[str]) -> LineageReport:
    """The lineage of ``rollout_ids`` alone: for each of them the ``Rollout`` (state, attempt, steps)
    and the violations and warnings that ``read_lineage`` over the whole ledger gives them; rollouts
    the ledger never names are absent. Reads the events the module docstring lists, through the
    ``rollout_refs`` projection and the ledger's indexes: it grows with those rollouts' own history,
    not with the ledger's."""
    ids = sorted(set(rollout_ids))
    report = LineageReport()
    ref_seqs = await ledger.rollout_ref_seqs(ids) if ids else []
    if not ref_seqs:
        return report
    events: dict[int, Event] = {e.seq: e for e in await ledger.events_at(ref_seqs)}
    saves: dict[str, list[Event]] = {}  # checkpoint id -> its _SAVE_KINDS events, in seq order

    async def add_checkpoints(cids: set[str]) -> None:
        wanted = sorted(cids - saves.keys())
        for cid in wanted:
            saves[cid] = []
        for event in await ledger.checkpoint_events(wanted, _SAVE_KINDS) if wanted else []:
            events.setdefault(event.seq, event)
            if event.checkpoint_id is not None:
                saves[event.checkpoint_id].append(event)

    async def fetch(seqs: Iterable[int]) -> None:
        for event in await ledger.events_at(sorted(set(seqs) - events.keys())):
            events[event.seq] = event

    referenced = {e.checkpoint_id for e in events.values() if e.checkpoint_id is not None}
    await add_checkpoints(referenced)
    published = {
        e.seq
        for cid in referenced
        for e in saves[cid]
        if e.kind == "attempt.published" and _effective(e.seq, saves[cid])
    }
    anchors = sorted(set(ref_seqs) | published)
    gaps: list[tuple[int, int | None]] = [
        (a, anchors[i + 1] if i + 1 < len(anchors) else None) for i, a in enumerate(anchors)
    ]
    # the first continuation in each gap (every one counts) ...
    await fetch(s for s in await ledger.first_in_ranges(CONTINUATION_KINDS, gaps) if s is not None)
    # ... and the first effective publication of a save (past an ineffective one: look further)
    todo = gaps
    while todo:
        found = await ledger.first_in_ranges(("attempt.published",), todo)
        hits = [(hi, seq) for (_, hi), seq in zip(todo, found, strict=True) if seq is not None]
        await fetch(seq for _, seq in hits)
        await add_checkpoints({cid for _, s in hits if (cid := events[s].checkpoint_id) is not None})
        todo = [
            (seq, hi)
            for hi, seq in hits
            if not _effective(seq, saves.get(events[seq].checkpoint_id or "", []))
        ]
    # the discoveries the fold reads at their own publications and continuations
    starts: dict[str, set[str]] = {}
    for cid in referenced:
        for event in saves[cid]:
            if event.kind == "attempt.started":
                starts.setdefault(cid, set()).update(str(p) for p in as_list(event.data.get("participants")))
    needs: dict[int, set[str]] = {}
    for seq in published:
        servers = starts.get(events[seq].checkpoint_id or "", set())
        if servers:
            needs[seq] = servers
    for seq in ref_seqs:
        if events[seq].kind in CONTINUATION_KINDS:
            needs[seq] = _continuing(events[seq])
    await _add_discoveries(ledger, events, needs)
    fold = LineageFold(steps=True, only=ids)
    for seq in sorted(events):
        fold.feed(events[seq])
    full = fold.finish()
    wanted = set(ids)
    report.rollouts = {r: full.rollouts[r] for r in ids if r in full.rollouts}
    report.violations = [v for v in full.violations if v.rollout_id in wanted]
    report.warnings = [v for v in full.warnings if v.rollout_id in wanted]
    return report


def _continuing(event: Event) -> set[str]:
    """The servers (v2) or agents (v1) a continuation names."""
    servers: set[str] = set()
    for name in ("restored", "continued", "discarded"):
        groups = event.data.get(name)
        if isinstance(groups, Mapping):
            servers.update(str(s) for s in groups)
    return servers


def _listed(discovery: Event) -> set[str]:
    return {
        str(p["name"])
        for p in as_list(discovery.data.get("participants"))
        if isinstance(p, Mapping) and isinstance(p.get("name"), str)
    }


async def _add_discoveries(ledger: _Reads, events: dict[int, Event], needs: dict[int, set[str]]) -> None:
    """Add to ``events`` the ``discovery.completed`` events the fold reads at each seq of ``needs``
    (seq -> the servers it asks about): from the last one before it, back until each is listed."""
    discoveries: dict[int, Event] = {}
    while needs:
        asked = sorted(needs)
        step: dict[int, set[str]] = {}
        for seq, before in zip(asked, await ledger.last_before_each(_DISCOVERY, asked), strict=True):
            if before is not None:
                step.setdefault(before, set()).update(needs[seq])
        for event in await ledger.events_at(sorted(step.keys() - discoveries.keys())):
            discoveries[event.seq] = event
        needs = {}
        for seq, servers in step.items():
            left = servers - _listed(discoveries[seq])
            if left:
                needs[seq] = left
    events.update(discoveries)


async def read_lineage_of(ledger: Any, only: Sequence[str] | None) -> LineageReport:
    """The lineage of every rollout (``only`` None: the whole fold, ``read_lineage``) or of the
    rollouts ``only`` names alone (``read_rollout_lineage``: the same rollouts, violations and
    warnings, read through the ``rollout_refs`` projection). The report holds the rollouts read,
    so its ``counts()`` count those: every rollout, or the ones named that the ledger recorded."""
    if only:
        return await read_rollout_lineage(ledger, only)
    return await read_lineage(ledger, steps=True)
