"""The rollout lineage: from the ledger's events alone, what became of every rollout attempt.

A fold over events in seq order (``LineageFold.feed``; ``read_lineage`` reads the few kinds it
needs). It keeps one small record per rollout — its newest attempt, its state, the obligation a
restore left it, the highest attempt retired — and, when asked, its steps.

What counts, and when:

- **captured** — a save's inventory counts once the save is published (``attempt.published``):
  on Gym's unified plane (v2) the commit scope (``episodes.scoped``; restarts are left out of
  it) with what each server exported of it (``episodes.exported``), on v1 every agent's
  continuation rows (``rollouts.captured``). A save that aborts captured nothing; a save
  published without its inventory recorded (a crash or power loss took those staged records and
  recovery found the snapshot; a ledger older than these events) is passed over: it shows
  nothing captured, ended or lost.
- **continued** — a restore's next attempts (v2 ``episodes.restored``, v1 ``rollouts.continued``
  — the resubmissions) count when recorded: the restored servers hold them from then on. A
  restore puts the run back at its snapshot, so the obligations left by anything before it end
  there. Each continued attempt owes a later save: it is captured again, finished, retired or
  restarted, or the rollout is **lost** — the first published save that does not capture it
  shows the loss. Until such a save, it is live.
- **restarted** — left out of a save's scope as a restart (v2) or discarded by a restore (v1,
  its continuation depended on a ``restart_only`` resources server): the trainer starts it over.
- **retired** — ``episodes.retired``: Gym refuses that attempt and every earlier one until the
  rollout is forgotten. **finished** — acknowledged (v1 ``rollouts.acknowledged``) or
  forgotten (v2 ``rollouts.forgotten``, which also lifts the retire mark).

Rules (``LineageViolation.rule``; each names the rollout and the seq of the event that shows it):

- ``lost`` — a continued attempt missing from the next published save, neither finished,
  retired nor restarted meanwhile. On v1, where the agent holding it does not report finished
  results (no ``completed_result_acknowledgement`` in its recorded features), a finish cannot be
  told from a loss: that is a warning, not a violation.
- ``twice`` — two attempts of one rollout live at once: one save captures two attempts of it, or
  captures an attempt older than the one a restore continued since.
- ``retired`` — a save captures an attempt at or below the rollout's retire mark. A restore goes
  into fresh servers, which hold no marks: it clears them (a failed restore's next attempts,
  retired on the servers it leaves, are continued again by the restore that retries it).
- ``inventory`` — a published v2 save whose scope names an episode that no environment server
  exported (no participant at all, in a cluster without one): its state was not saved.

What the lineage cannot see: work the trainer never reported to quiesce — a rollout it
acknowledged or forgot by talking to Gym directly looks lost; ``expect_difference`` compares the
trainer's own view of what is live.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

from quiesce.ledger.events import Event

__all__ = [
    "LINEAGE_KINDS",
    "STATES",
    "LineageFold",
    "LineageReport",
    "LineageViolation",
    "Rollout",
    "Step",
    "StepKind",
    "as_list",
    "episode_of_capture_key",
    "expect_difference",
    "read_lineage",
    "rollout_pairs",
]

State = Literal["live", "restarted", "retired", "finished", "lost"]
#: What a lineage step says happened (``Step.what``).
StepKind = Literal[
    "captured", "restart", "continued", "discarded", "retired", "forgotten", "acknowledged", "ended", "lost"
]
#: The states a rollout can be in, as of the ledger's last event.
STATES: Final[tuple[State, ...]] = ("live", "restarted", "retired", "finished", "lost")
#: The event kinds the lineage reads (every other kind changes nothing in it).
LINEAGE_KINDS: Final = (
    "discovery.completed",
    "attempt.started",
    "attempt.published",
    "attempt.aborted",
    "episodes.scoped",
    "episodes.exported",
    "episodes.restored",
    "episodes.retired",
    "rollouts.forgotten",
    "rollouts.captured",
    "rollouts.acknowledged",
    "rollouts.continued",
)
#: The capability feature with which a v1 agent holds each finished result until acknowledged.
ACKNOWLEDGING: Final = "completed_result_acknowledgement"
_ATTEMPT_SUFFIX: Final = re.compile(r"-a([1-9][0-9]*)$")


def episode_of_capture_key(key: str) -> tuple[str, int]:
    """``(rollout_id, attempt)`` of a v2 capture key (``<rollout_id>`` for attempt 0,
    ``<rollout_id>-a<n>`` after; Gym's unified plane refuses rollout ids that end in ``-a<n>``)."""
    match = _ATTEMPT_SUFFIX.search(key)
    if match is None:
        return key, 0
    return key[: match.start()], int(match.group(1))


@dataclass(frozen=True, slots=True)
class Step:
    """One thing the ledger says happened to a rollout: ``what`` happened to ``attempt`` (None:
    the whole rollout) at ``seq``, by checkpoint ``checkpoint_id`` (None for an acknowledgement or
    a retire outside any attempt), on ``servers``; ``detail`` says more where there is more."""

    seq: int
    what: StepKind
    attempt: int | None
    checkpoint_id: str | None
    servers: tuple[str, ...] = ()
    detail: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "what": self.what,
            "attempt": self.attempt,
            "checkpoint_id": self.checkpoint_id,
            "servers": list(self.servers),
            "detail": self.detail,
        }


@dataclass(slots=True)
class Rollout:
    """One rollout as of the events folded so far: its newest attempt, its ``state`` and, when the
    fold keeps them, its ``steps``. ``owed`` is the continued attempt still owed to a later save
    (with the seq and id of the restore that continued it); ``mark`` the highest retired attempt."""

    rollout_id: str
    attempt: int = 0
    state: State = "live"
    steps: list[Step] = field(default_factory=list)
    owed: tuple[int, int, str | None, bool] | None = None  # attempt, seq, restore id, finish visible
    mark: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id,
            "attempt": self.attempt,
            "state": self.state,
            "steps": [s.to_json() for s in self.steps],
        }


@dataclass(frozen=True, slots=True)
class LineageViolation:
    """One broken lineage rule, at the seq of the event that shows it."""

    seq: int
    rule: Literal["lost", "twice", "retired", "inventory", "expect"]
    checkpoint_id: str | None
    rollout_id: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "rule": self.rule,
            "checkpoint_id": self.checkpoint_id,
            "rollout_id": self.rollout_id,
            "message": self.message,
        }


@dataclass(slots=True)
class LineageReport:
    """The fold's result: every rollout seen, the rule breaches, and the warnings."""

    rollouts: dict[str, Rollout] = field(default_factory=dict)
    violations: list[LineageViolation] = field(default_factory=list)
    warnings: list[LineageViolation] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """How many rollouts are in each state (every state named, zeros included)."""
        out: dict[str, int] = dict.fromkeys(STATES, 0)
        for rollout in self.rollouts.values():
            out[rollout.state] += 1
        return out


@dataclass(slots=True)
class _Save:
    """A save attempt not yet published: what it will have captured once it is."""

    plane: str
    scope: set[tuple[str, int]] | None = None
    restarts: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    exported: dict[str, set[tuple[str, int]]] = field(default_factory=dict)
    captured: dict[tuple[str, int], list[str]] = field(default_factory=dict)  # v1: pair -> agents
    #: its inventory was recorded (v2 ``episodes.scoped`` and then ``episodes.exported``, v1
    #: ``rollouts.captured``): a save published without it (a crash or power loss took the staged
    #: records, recovery found the snapshot; or a ledger older than these events) says nothing of
    #: what it captured
    known: bool = False
    participants: tuple[str, ...] = ()


class LineageFold:
    """Feed events in seq order (``feed``), then ``finish()``; see the module docstring.

    ``steps``: keep each rollout's steps (``quiesce rollouts``); without, only its state (``check``:
    memory per rollout stays a few hundred bytes). ``only``: keep steps of these rollouts alone.
    ``on_step``: called with every step as it is made, in seq order, kept or not (counters)."""

    def __init__(
        self,
        *,
        steps: bool = False,
        only: Iterable[str] | None = None,
        on_step: Callable[[Rollout, Step], None] | None = None,
    ) -> None:
        self._steps = steps
        self._only = frozenset(only) if only is not None else None
        self.on_step = on_step
        self.report = LineageReport()
        self._saves: dict[str, _Save] = {}
        self._kinds: dict[str, str] = {}  # server -> component (v2: its kind)
        self._features: dict[str, frozenset[str] | None] = {}  # server -> v1 features, None: unknown
        self._live: set[str] = set()  # the rollouts in state live
        self._marked: set[str] = set()  # the rollouts with a retire mark
        self._events = 0

    # -- feeding -----------------------------------------------------------------------------

    def feed(self, event: Event) -> None:
        """Fold one event (any kind; only ``LINEAGE_KINDS`` change anything)."""
        handler = _HANDLERS.get(event.kind)
        if handler is not None:
            handler(self, event)

    def feed_all(self, events: Iterable[Event]) -> LineageFold:
        for event in events:
            self.feed(event)
        return self

    def finish(self) -> LineageReport:
        """The report as of the last event fed (attempts still owed a save are live)."""
        return self.report

    # -- the rollout records ----------------------------------------------------------------

    def _rollout(self, rollout_id: str) -> Rollout:
        rollouts = self.report.rollouts
        rollout = rollouts.get(rollout_id)
        if rollout is None:
            rollout = rollouts[rollout_id] = Rollout(rollout_id)
        return rollout

    def _step(self, rollout: Rollout, step: Step) -> None:
        if self.on_step is not None:
            self.on_step(rollout, step)
        if self._steps and (self._only is None or rollout.rollout_id in self._only):
            rollout.steps.append(step)

    def _violate(
        self,
        seq: int,
        rule: Any,
        checkpoint_id: str | None,
        rollout_id: str,
        message: str,
        *,
        warn: bool = False,
    ) -> None:
        target = self.report.warnings if warn else self.report.violations
        target.append(LineageViolation(seq, rule, checkpoint_id, rollout_id, message))

    # -- handlers ---------------------------------------------------------------------------

    def _discovered(self, event: Event) -> None:
        for p in as_list(event.data.get("participants")):
            if isinstance(p, Mapping) and isinstance(p.get("name"), str):
                name = p["name"]
                self._kinds[name] = str(p.get("component"))
                features = p.get("features")
                self._features[name] = (
                    frozenset(str(f) for f in features) if isinstance(features, list) else None
                )

    def _started(self, event: Event) -> None:
        data = event.data
        if data.get("kind") == "save" and event.checkpoint_id is not None:
            self._saves[event.checkpoint_id] = _Save(
                str(data.get("plane", "v1")),
                participants=tuple(str(p) for p in as_list(data.get("participants"))),
            )

    def _scoped(self, event: Event) -> None:
        save = self._saves.get(event.checkpoint_id or "")
        if save is None:
            return
        save.scope = {episode_of_capture_key(str(k)) for k in as_list(event.data.get("scope"))}
        restarts = event.data.get("restarts")
        if isinstance(restarts, Mapping):
            for server, keys in restarts.items():
                for key in as_list(keys):
                    save.restarts.setdefault(episode_of_capture_key(str(key)), []).append(str(server))

    def _exported(self, event: Event) -> None:
        save = self._saves.get(event.checkpoint_id or "")
        exported = event.data.get("exported")
        if save is None or not isinstance(exported, Mapping):
            return
        for server, keys in exported.items():
            save.exported.setdefault(str(server), set()).update(
                episode_of_capture_key(str(k)) for k in as_list(keys)
            )
        save.known = save.scope is not None  # the scope, then what was exported of it

    def _captured_v1(self, event: Event) -> None:
        save = self._saves.get(event.checkpoint_id or "")
        captured = event.data.get("captured")
        if save is None or not isinstance(captured, Mapping):
            return
        save.known = True
        for agent, pairs in captured.items():
            for pair in rollout_pairs(pairs):
                save.captured.setdefault(pair, []).append(str(agent))

    def _aborted(self, event: Event) -> None:
        self._saves.pop(event.checkpoint_id or "", None)

    def _published(self, event: Event) -> None:
        cid = event.checkpoint_id
        save = self._saves.pop(cid or "", None)
        if save is None or not save.known:
            return
        seq = event.seq
        if save.plane == "v2":
            inventory = save.scope or set()
            holders: dict[tuple[str, int], list[str]] = {}
            for server, pairs in save.exported.items():
                for pair in pairs & inventory:
                    holders.setdefault(pair, []).append(server)
            captured = {pair: sorted(holders.get(pair, [])) for pair in inventory}
            self._check_inventory(seq, cid, save, inventory)
        else:
            captured = {pair: sorted(agents) for pair, agents in save.captured.items()}
        by_rollout: dict[str, list[int]] = {}
        for rollout_id, attempt in captured:
            by_rollout.setdefault(rollout_id, []).append(attempt)
        for rollout_id, attempts in by_rollout.items():
            rollout = self._rollout(rollout_id)
            attempts.sort()
            if len(attempts) > 1:
                self._violate(
                    seq,
                    "twice",
                    cid,
                    rollout_id,
                    f"checkpoint {cid} captured attempts {', '.join(map(str, attempts))} of rollout"
                    f" {rollout_id} at once: only one attempt of a rollout may be live",
                )
            newest = attempts[-1]
            for attempt in attempts:
                self._capture(rollout, attempt, seq, cid, tuple(captured[(rollout_id, attempt)]))
            rollout.attempt = max(rollout.attempt, newest)
        for pair, servers in save.restarts.items():
            if pair in captured:
                continue
            rollout = self._rollout(pair[0])
            rollout.state, rollout.owed = "restarted", None
            self._live.discard(pair[0])
            rollout.attempt = max(rollout.attempt, pair[1])
            self._step(rollout, Step(seq, "restart", pair[1], cid, tuple(sorted(servers))))
        # a live rollout this save did not capture has ended: lost if a restore continued it and
        # nothing since says where it went (module docstring), else it left the servers: finished
        for rollout_id in sorted(self._live - by_rollout.keys()):
            rollout = self._rollout(rollout_id)
            owed = rollout.owed
            rollout.owed = None
            if owed is None:
                rollout.state = "finished"
                self._step(
                    rollout,
                    Step(
                        seq,
                        "ended",
                        rollout.attempt,
                        cid,
                        detail=f"not in checkpoint {cid}: it left the servers (no acknowledgement or"
                        " forget recorded)",
                    ),
                )
                continue
            attempt, restored_at, restore_id, visible = owed
            rollout.state = "lost"
            self._step(rollout, Step(seq, "lost", attempt, cid, detail=f"missing from checkpoint {cid}"))
            self._violate(
                seq,
                "lost",
                cid,
                rollout_id,
                f"rollout {rollout_id} attempt {attempt}, continued by restore {restore_id}"
                f" (seq {restored_at}), is missing from checkpoint {cid}: not captured again, not"
                " finished (acknowledged or forgotten), not retired, not restarted"
                + (
                    ""
                    if visible
                    else "; its agent does not report finished results, so it may"
                    " have finished: compare with the trainer's view (`quiesce check --expect`)"
                ),
                warn=not visible,
            )
        self._live = {rid for rid in by_rollout if self.report.rollouts[rid].state == "live"}

    def _capture(
        self, rollout: Rollout, attempt: int, seq: int, cid: str | None, servers: tuple[str, ...]
    ) -> None:
        rid = rollout.rollout_id
        if rollout.mark is not None and attempt <= rollout.mark:
            self._violate(
                seq,
                "retired",
                cid,
                rid,
                f"checkpoint {cid} captured attempt {attempt} of rollout {rid}, retired up to attempt"
                f" {rollout.mark}: a retired attempt ran on",
            )
        owed = rollout.owed
        if owed is not None and attempt < owed[0]:
            self._violate(
                seq,
                "twice",
                cid,
                rid,
                f"checkpoint {cid} captured attempt {attempt} of rollout {rid}, which restore"
                f" {owed[2]} (seq {owed[1]}) continued as attempt {owed[0]}: the old attempt ran on",
            )
        rollout.owed = None
        rollout.state = "live"
        self._step(rollout, Step(seq, "captured", attempt, cid, servers))

    def _check_inventory(
        self, seq: int, cid: str | None, save: _Save, inventory: set[tuple[str, int]]
    ) -> None:
        environments = [s for s in save.participants if self._kinds.get(s) == "environment"]
        holders = environments or list(save.exported)
        held: set[tuple[str, int]] = set()
        for server in holders:
            held |= save.exported.get(server, set())
        for rollout_id, attempt in sorted(inventory - held):
            who = "environment server" if environments else "participant"
            self._violate(
                seq,
                "inventory",
                cid,
                rollout_id,
                f"checkpoint {cid}'s scope names attempt {attempt} of rollout {rollout_id}, which no"
                f" {who} exported: its state was not saved",
            )

    def _continued(self, event: Event) -> None:
        """A restore's next attempts (v2 ``episodes.restored``, v1 ``rollouts.continued``)."""
        cid, seq, data = event.checkpoint_id, event.seq, event.data
        continued: dict[tuple[str, int], list[str]] = {}
        discarded: dict[tuple[str, int], list[str]] = {}
        if event.kind == "episodes.restored":
            restored = data.get("restored")
            for server, keys in restored.items() if isinstance(restored, Mapping) else ():
                for key in as_list(keys):
                    continued.setdefault(episode_of_capture_key(str(key)), []).append(str(server))
        else:
            for name, target in (("continued", continued), ("discarded", discarded)):
                groups = data.get(name)
                for agent, pairs in groups.items() if isinstance(groups, Mapping) else ():
                    for pair in rollout_pairs(pairs):
                        target.setdefault(pair, []).append(str(agent))
        source = data.get("source_checkpoint_id")
        # the run is back at the snapshot: what was live is either continued below or gone with
        # the run the restore replaced (the trainer starts it over)
        before, self._live = self._live, set()
        # a restore goes into fresh servers: the retire marks of the servers it replaced are gone
        for rollout_id in self._marked:
            self.report.rollouts[rollout_id].mark = None
        self._marked = set()
        continued_ids = {rollout_id for rollout_id, _ in continued}
        for rollout_id in sorted(before - continued_ids):
            rollout = self._rollout(rollout_id)
            rollout.owed, rollout.state = None, "restarted"
            self._step(
                rollout,
                Step(
                    seq,
                    "restart",
                    rollout.attempt,
                    cid,
                    detail=f"not in snapshot {source}: restore {cid} replaced the run it was live in",
                ),
            )
        for (rollout_id, attempt), servers in sorted(continued.items()):
            rollout = self._rollout(rollout_id)
            visible = event.kind == "episodes.restored" or all(
                ACKNOWLEDGING in (self._features.get(s) or ()) for s in servers
            )
            rollout.owed = (attempt, seq, cid, visible)
            rollout.state = "live"
            self._live.add(rollout_id)
            rollout.attempt = max(rollout.attempt, attempt)
            self._step(
                rollout, Step(seq, "continued", attempt, cid, tuple(sorted(servers)), f"from {source}")
            )
        for (rollout_id, attempt), servers in sorted(discarded.items()):
            rollout = self._rollout(rollout_id)
            rollout.owed, rollout.state = None, "restarted"
            rollout.attempt = max(rollout.attempt, attempt)
            self._live.discard(rollout_id)
            self._step(
                rollout, Step(seq, "discarded", attempt, cid, tuple(sorted(servers)), f"from {source}")
            )

    def _retired(self, event: Event) -> None:
        data = event.data
        servers = tuple(str(s) for s in as_list(data.get("servers")))
        for key in as_list(data.get("episodes")):
            rollout_id, attempt = episode_of_capture_key(str(key))
            rollout = self._rollout(rollout_id)
            rollout.mark = attempt if rollout.mark is None else max(rollout.mark, attempt)
            self._marked.add(rollout_id)
            if rollout.owed is not None and rollout.owed[0] <= attempt:
                rollout.owed = None
            if attempt >= rollout.attempt:
                rollout.state = "retired"
                rollout.attempt = attempt
                self._live.discard(rollout_id)
            self._step(
                rollout,
                Step(event.seq, "retired", attempt, event.checkpoint_id, servers, str(data.get("reason"))),
            )

    def _forgotten(self, event: Event) -> None:
        servers = tuple(str(s) for s in as_list(event.data.get("servers")))
        for rollout_id in as_list(event.data.get("rollout_ids")):
            rollout = self._rollout(str(rollout_id))
            rollout.owed, rollout.mark, rollout.state = None, None, "finished"
            self._marked.discard(rollout.rollout_id)
            self._live.discard(rollout.rollout_id)
            self._step(rollout, Step(event.seq, "forgotten", None, event.checkpoint_id, servers))

    def _acknowledged(self, event: Event) -> None:
        server = (event.server,) if event.server else ()
        for rollout_id, attempt in rollout_pairs(event.data.get("executions")):
            rollout = self._rollout(rollout_id)
            if rollout.owed is not None and rollout.owed[0] <= attempt:
                rollout.owed = None
            if attempt >= rollout.attempt:
                rollout.state, rollout.attempt = "finished", attempt
                self._live.discard(rollout_id)
            self._step(rollout, Step(event.seq, "acknowledged", attempt, None, server))


_HANDLERS: Final = {
    "discovery.completed": LineageFold._discovered,
    "attempt.started": LineageFold._started,
    "attempt.published": LineageFold._published,
    "attempt.aborted": LineageFold._aborted,
    "episodes.scoped": LineageFold._scoped,
    "episodes.exported": LineageFold._exported,
    "episodes.restored": LineageFold._continued,
    "episodes.retired": LineageFold._retired,
    "rollouts.forgotten": LineageFold._forgotten,
    "rollouts.captured": LineageFold._captured_v1,
    "rollouts.acknowledged": LineageFold._acknowledged,
    "rollouts.continued": LineageFold._continued,
}
assert set(_HANDLERS) == set(LINEAGE_KINDS)


def as_list(value: Any) -> list[Any]:
    """``value`` if it is a list, else empty: how every lineage parser reads a list field."""
    return value if isinstance(value, list) else []


def rollout_pairs(value: Any) -> Iterable[tuple[str, int]]:
    """The ``(rollout_id, attempt)`` of a list of ``{"rollout_id", "attempt"}`` items: a str id
    and an int attempt, else the item is skipped (the lineage fold and ``rollout_refs`` agree)."""
    for item in as_list(value):
        if isinstance(item, Mapping):
            rollout_id, attempt = item.get("rollout_id"), item.get("attempt")
            if isinstance(rollout_id, str) and type(attempt) is int:
                yield rollout_id, attempt


class _Reads(Protocol):
    def read(self, *, kinds: Sequence[str] | None = None) -> AsyncIterator[Event]: ...


async def read_lineage(
    ledger: _Reads, *, steps: bool = True, only: Iterable[str] | None = None
) -> LineageReport:
    """The lineage of ``ledger`` (any object with ``Ledger.read``): its lineage kinds folded in seq order."""
    fold = LineageFold(steps=steps, only=only)
    async for event in ledger.read(kinds=LINEAGE_KINDS):
        fold.feed(event)
    return fold.finish()


def expect_difference(report: LineageReport, expected: Iterable[tuple[str, int]]) -> list[LineageViolation]:
    """The trainer's view (``expected``: the (rollout id, attempt) pairs it believes live) against
    the lineage: each pair the ledger does not show live at that attempt, and each rollout the
    ledger shows live that the trainer does not hold. Rule ``expect``, seq 0 (the ledger's end)."""
    out: list[LineageViolation] = []
    believed: dict[str, set[int]] = {}
    for rollout_id, attempt in expected:
        believed.setdefault(rollout_id, set()).add(attempt)
    for rollout_id, attempts in sorted(believed.items()):
        rollout = report.rollouts.get(rollout_id)
        for attempt in sorted(attempts):
            if rollout is None:
                said = "the ledger never saw this rollout"
            elif rollout.state != "live":
                said = f"the ledger has it {rollout.state} (attempt {rollout.attempt})"
            elif rollout.attempt != attempt:
                said = f"the ledger has attempt {rollout.attempt} live"
            else:
                continue
            out.append(
                LineageViolation(
                    0,
                    "expect",
                    None,
                    rollout_id,
                    f"the trainer holds attempt {attempt} of rollout {rollout_id} live; {said}",
                )
            )
        if len(attempts) > 1:
            out.append(
                LineageViolation(
                    0,
                    "expect",
                    None,
                    rollout_id,
                    f"the trainer holds attempts {', '.join(map(str, sorted(attempts)))} of rollout"
                    f" {rollout_id} live at once",
                )
            )
    for rollout_id, rollout in sorted(report.rollouts.items()):
        if rollout.state == "live" and rollout_id not in believed:
            out.append(
                LineageViolation(
                    0,
                    "expect",
                    None,
                    rollout_id,
                    f"the ledger has attempt {rollout.attempt} of rollout {rollout_id} live; the trainer"
                    " does not hold it",
                )
            )
    return out
