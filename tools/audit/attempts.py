"""Rebuild one checkpoint attempt from its ledger events.

`build_attempt(events)` takes the events of one attempt (those whose `checkpoint_id` is the
attempt's id, in seq order; other events are ignored) and returns an `AttemptView`:

- `calls`: one `Call` per `call.sent`, in seq order, paired by `call_id` with its outcome
  (`call.replied` / `call.failed`). An outcome without a matching `call.sent`, or a second outcome
  for the same `call_id`, is kept in `pairing_errors` (seq, message) and never paired.
- `phases`: one `PhaseSpan` per `phase.started`, closed by the next `phase.completed` /
  `phase.failed` of the same phase name.
- `recovery`: every `recovery.settled` of the attempt, in order.
- `matrix()`: the participant × phase matrix (see `Cell`).
- `plane` (`v1`, or `v2` for Gym's unified plane, as `attempt.started` records it) and, for a v2
  attempt, `v2` (`V2Facts`): the episodes its `episodes.*` events recorded, its renewals, its
  retires; the participants' kinds come from the last `discovery.completed` before it.
- for a v1 attempt that recorded its rollouts, `rollouts` (`RolloutFacts`): what its
  `rollouts.captured` (a save's commit) and `rollouts.continued` (a restore) say, per agent.
  `rollouts.acknowledged` names no attempt (it is the agent's, `server`), so no view holds it.

Invariants: a call's `outcome` is `acknowledged` only for a `call.replied` with a 2xx status;
any other reply and every `call.failed` is `failed`; a call with no outcome event is `unknown`.
Times are Unix seconds parsed from the events' UTC `at`; nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal

from quiesce.coordinator.protocol import CAPABILITIES_PATH, INVALID_PHASE, PREFIX, ROUTES
from quiesce.coordinator.protocol_v2 import CHECKPOINT_CONFLICT
from quiesce.coordinator.protocol_v2 import PREFIX as V2_PREFIX
from quiesce.coordinator.protocol_v2 import ROUTES as V2_ROUTES
from quiesce.ledger.events import Event
from quiesce.tools.audit.operations import EpisodeOperation, episode_operation

Outcome = Literal["acknowledged", "failed", "unknown"]

#: Phases whose calls compensate (resume servers an attempt touched) rather than advance it.
COMPENSATING_PHASES: Final = frozenset({"rollback", "recovery"})
#: Column order of the participant × phase matrix.
MATRIX_PHASES: Final = (
    "prepare",
    "commit",
    "renew",
    "restore",
    "retire",
    "forget",
    "resume",
    "rollback",
    "recovery",
)
#: Operations of Gym's unified plane that act on episodes rather than on a checkpoint.
EPISODE_OPERATIONS: Final = frozenset({"retire", "forget"})
TERMINAL_KINDS: Final = frozenset({"attempt.aborted", "attempt.completed"})

# Control path (without the v1 prefix) -> (component, operation), from the wire route table.
_BY_PATH: Final[dict[str, tuple[str, str]]] = {r.path: (r.component, r.operation) for r in ROUTES.values()}


def parse_at(at: str) -> float:
    """Unix seconds of an event's `at` (UTC ISO-8601, `Z` suffix)."""
    return datetime.fromisoformat(at).timestamp()


def classify_path(path: str) -> tuple[str | None, str | None]:
    """(component, operation) of a control path, e.g. `/ng-control/v1/model-admission/pause`.

    The capabilities route gives `(None, "capabilities")`; an unknown path gives `(None, None)`.
    A query string is ignored; the path may be given with or without the `/ng-control/v1` prefix.
    A unified-plane (v2) path gives `(None, operation)`: its routes are the same for every kind
    (`is_v2_path` tells them apart; the kind comes from discovery).
    """
    bare = path.split("?", 1)[0]
    if bare == CAPABILITIES_PATH or bare == "/capabilities":
        return None, "capabilities"
    if is_v2_path(bare):
        operation = bare[len(V2_PREFIX) + 1 :]
        return None, (operation if operation in V2_ROUTES else None)
    if bare.startswith(PREFIX):
        bare = bare[len(PREFIX) :]
    found = _BY_PATH.get(bare)
    return found if found is not None else (None, None)


def is_v2_path(path: str) -> bool:
    """Whether `path` is a route of Gym's unified plane (`/ng-control/v1/checkpoint/...`)."""
    return path.split("?", 1)[0].startswith(V2_PREFIX + "/")


def capture_key(episode: Any) -> str | None:
    """The capture key of an episode as a request body carries it (`{"rollout_id", "attempt"}`:
    `<rollout_id>` for attempt 0, `<rollout_id>-a<n>` after), or of a key given as a string."""
    if isinstance(episode, str):
        return episode
    if not isinstance(episode, Mapping):
        return None
    rollout = episode.get("rollout_id")
    attempt = episode.get("attempt", 0)
    if not isinstance(rollout, str) or not isinstance(attempt, int) or isinstance(attempt, bool):
        return None
    return rollout if attempt == 0 else f"{rollout}-a{attempt}"


def next_attempt_key(key: str) -> str:
    """The capture key of the attempt after `key`'s (`r1` → `r1-a1`, `r1-a1` → `r1-a2`)."""
    rollout, sep, n = key.rpartition("-a")
    if sep and rollout and n.isdigit() and not n.startswith("0"):
        return f"{rollout}-a{int(n) + 1}"
    return f"{key}-a1"


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _error_code(body: Any) -> str | None:
    """`error.code` of a Gym rejection body `{"error": {"code", ...}}`, if present."""
    if isinstance(body, Mapping):
        error = body.get("error")
        if isinstance(error, Mapping):
            return _str(error.get("code"))
    return None


@dataclass(slots=True)
class Call:
    """One control call: its `call.sent` and, when recorded, its outcome."""

    call_id: str
    server: str
    phase: str
    method: str
    path: str
    url: str
    component: str | None
    operation: str | None
    timeout_s: float | None
    sent_seq: int
    sent_at: str
    sent_ts: float
    epoch: int
    outcome: Outcome = "unknown"
    outcome_seq: int | None = None
    outcome_at: str | None = None
    outcome_ts: float | None = None
    status: int | None = None
    error: str | None = None
    code: str | None = None
    detail: str | None = None
    elapsed_s: float | None = None

    @property
    def route(self) -> str:
        return f"{self.method} {self.path}"

    @property
    def result(self) -> str:
        """Short outcome text: the status, or the error and its code, or `unknown`."""
        if self.outcome == "unknown":
            return "unknown"
        if self.outcome == "acknowledged":
            return str(self.status)
        status = str(self.status) if self.status is not None else None
        parts = [p for p in (self.error, status, self.code) if p]
        return " ".join(parts) or "failed"

    @property
    def not_paused(self) -> bool:
        """A resume refused with 409 `invalid_phase` (v1) or `checkpoint_conflict` (v2: another id
        holds the server): the server was never paused by this attempt (nothing to undo)."""
        if self.operation != "resume" or self.status != 409:
            return False
        return self.code == (CHECKPOINT_CONFLICT if is_v2_path(self.path) else INVALID_PHASE)

    @property
    def settles(self) -> bool:
        """This call leaves its server accepting: an acknowledged resume, or a resume of a server
        that was never paused."""
        return self.operation == "resume" and (self.outcome == "acknowledged" or self.not_paused)

    def to_json(self) -> dict[str, Any]:
        return {
            "call_id": self.call_id,
            "server": self.server,
            "phase": self.phase,
            "method": self.method,
            "path": self.path,
            "url": self.url,
            "component": self.component,
            "operation": self.operation,
            "timeout_s": self.timeout_s,
            "sent_seq": self.sent_seq,
            "sent_at": self.sent_at,
            "epoch": self.epoch,
            "outcome": self.outcome,
            "outcome_seq": self.outcome_seq,
            "outcome_at": self.outcome_at,
            "status": self.status,
            "error": self.error,
            "code": self.code,
            "detail": self.detail,
            "elapsed_s": self.elapsed_s,
        }


@dataclass(slots=True)
class PhaseSpan:
    """One run of a phase: from its `phase.started` to its `phase.completed` / `phase.failed`."""

    phase: str
    started_seq: int
    start_ts: float
    end_seq: int | None = None
    end_ts: float | None = None
    status: Literal["open", "completed", "failed"] = "open"
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "started_seq": self.started_seq,
            "end_seq": self.end_seq,
            "status": self.status,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class Settled:
    """One `recovery.settled`: what a server reported to a recovering coordinator, and what it did."""

    seq: int
    at: str
    ts: float
    epoch: int
    server: str | None
    reported_phase: str | None
    active_checkpoint_id: str | None
    action: str | None
    result: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "at": self.at,
            "epoch": self.epoch,
            "server": self.server,
            "reported_phase": self.reported_phase,
            "active_checkpoint_id": self.active_checkpoint_id,
            "action": self.action,
            "result": self.result,
        }


@dataclass(frozen=True, slots=True)
class Cell:
    """One participant × phase cell.

    `intended`: the participation rule says this server takes part in this phase of this attempt
    (a participant, and the phase was started; for rollback and recovery: a server the attempt
    touched). `sent` counts calls; `acknowledged` / `failed` / `unknown` split them by outcome;
    `compensated` counts rollback/recovery resumes that left the server accepting.
    `state` summarises the cell: the last call's outcome (`compensated` for a settling
    rollback/recovery resume), `not sent` when intended but no call was sent, `""` otherwise.
    """

    intended: bool
    sent: int
    acknowledged: int
    failed: int
    unknown: int
    compensated: int
    state: str

    def to_json(self) -> dict[str, Any]:
        return {
            "intended": self.intended,
            "sent": self.sent,
            "acknowledged": self.acknowledged,
            "failed": self.failed,
            "unknown": self.unknown,
            "compensated": self.compensated,
            "state": self.state,
        }


def _keys(value: Any) -> tuple[str, ...]:
    return tuple(str(k) for k in value) if isinstance(value, list) else ()


def _per_server(value: Any) -> dict[str, tuple[str, ...]]:
    return {str(k): _keys(v) for k, v in value.items()} if isinstance(value, dict) else {}


@dataclass(slots=True)
class V2Facts:
    """What the ledger says of a unified-plane attempt beyond its calls.

    `kinds`: each participant's kind (`environment|model|agent|resources`), from the last
    `discovery.completed` before the attempt. `scope` / `scope_source` / `restarts`: its
    `episodes.scoped` (the commit scope, `given` or `derived`, and the restarts left out of it);
    `exported`: its `episodes.exported`; `blockers` / `blocker_counts`: its `episodes.blocked`
    (a prepare not ready by the deadline); `restored` / `restored_from`: its `episodes.restored`;
    `operations`: the retires and forgets recorded under it; `renewals`: renew calls sent, and
    `last_lease`: the latest `lease_expires_at` a renewal was granted (Unix seconds).
    """

    stop: bool = False
    kinds: dict[str, str] = field(default_factory=dict)
    scope: tuple[str, ...] | None = None
    scope_source: str | None = None
    restarts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    exported: dict[str, tuple[str, ...]] = field(default_factory=dict)
    blockers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    blocker_counts: dict[str, int] = field(default_factory=dict)
    restored: dict[str, tuple[str, ...]] = field(default_factory=dict)
    restored_from: str | None = None
    inventory: tuple[str, ...] | None = None
    operations: list[EpisodeOperation] = field(default_factory=list)
    renewals: int = 0
    last_lease: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "stop": self.stop,
            "kinds": dict(self.kinds),
            "scope": list(self.scope) if self.scope is not None else None,
            "scope_size": len(self.scope) if self.scope is not None else None,
            "scope_source": self.scope_source,
            "restarts": {n: list(k) for n, k in self.restarts.items()},
            "exported": {n: list(k) for n, k in self.exported.items()},
            "exported_counts": {n: len(k) for n, k in self.exported.items()},
            "blockers": {n: list(k) for n, k in self.blockers.items()},
            "blocker_counts": dict(self.blocker_counts),
            "restored_from": self.restored_from,
            "inventory": list(self.inventory) if self.inventory is not None else None,
            "restored": {n: list(k) for n, k in self.restored.items()},
            "operations": [o.to_json() for o in self.operations],
            "renewals": self.renewals,
            "last_lease": self.last_lease,
        }


Pair = tuple[str, int]


def _pairs(value: Any) -> tuple[Pair, ...]:
    """The `(rollout_id, attempt)` of each `{"rollout_id", "attempt"}` of a `rollouts.*` list
    (an item of another shape is left out)."""
    found: list[Pair] = []
    for item in value if isinstance(value, list) else ():
        if isinstance(item, Mapping):
            rollout, attempt = _str(item.get("rollout_id")), _int(item.get("attempt"))
            if rollout is not None and attempt is not None:
                found.append((rollout, attempt))
    return tuple(found)


def _pairs_json(pairs: tuple[Pair, ...]) -> list[dict[str, Any]]:
    return [{"rollout_id": rollout, "attempt": attempt} for rollout, attempt in pairs]


@dataclass(slots=True)
class RolloutFacts:
    """What the ledger says of a v1 attempt's rollouts, as `(rollout_id, attempt)` pairs per agent.

    `captured`: its `rollouts.captured` (a save's commit: each continuation row its agents saved).
    `continued_from` / `continued` / `discarded` / `unknown`: its `rollouts.continued` (a restore:
    the snapshot's checkpoint id, the executions each agent continues — their `/run` is sent again
    —, those discarded to start over, and the agents whose saved folder did not say, with why).
    """

    captured: dict[str, tuple[Pair, ...]] | None = None
    continued_from: str | None = None
    continued: dict[str, tuple[Pair, ...]] | None = None
    discarded: dict[str, tuple[Pair, ...]] = field(default_factory=dict)
    unknown: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.captured is not None:
            out["captured"] = {n: _pairs_json(p) for n, p in self.captured.items()}
        if self.continued is not None:
            out["continued_from"] = self.continued_from
            out["continued"] = {n: _pairs_json(p) for n, p in self.continued.items()}
            out["discarded"] = {n: _pairs_json(p) for n, p in self.discarded.items()}
            out["unknown"] = dict(self.unknown)
        return out


@dataclass(slots=True)
class AttemptView:
    """Everything the ledger says about one attempt. See the module docstring for the invariants."""

    checkpoint_id: str
    kind: str | None = None
    deadline_ts: float | None = None
    participants: tuple[str, ...] = ()
    epoch: int | None = None
    started_seq: int | None = None
    started_at: str | None = None
    start_ts: float | None = None
    first_seq: int | None = None
    last_seq: int | None = None
    end_ts: float | None = None
    events: int = 0
    calls: list[Call] = field(default_factory=list)
    phases: list[PhaseSpan] = field(default_factory=list)
    recovery: list[Settled] = field(default_factory=list)
    outcome: str | None = None
    terminal_seq: int | None = None
    terminal_at: str | None = None
    abort_reason: str | None = None
    left_paused: tuple[str, ...] = ()
    not_paused: tuple[str, ...] = ()
    published_dir: str | None = None
    publishing_seq: int | None = None
    pairing_errors: list[tuple[int, str]] = field(default_factory=list)
    plane: str = "v1"
    v2: V2Facts | None = None
    rollouts: RolloutFacts | None = None

    @property
    def terminal(self) -> bool:
        return self.terminal_seq is not None

    @property
    def duration_s(self) -> float | None:
        if self.start_ts is None or self.end_ts is None:
            return None
        return max(0.0, self.end_ts - self.start_ts)

    def servers(self) -> list[str]:
        """Participants first (in attempt order), then any other server a call went to."""
        seen = list(self.participants)
        for call in self.calls:
            if call.server not in seen:
                seen.append(call.server)
        return seen

    def touched(self) -> list[str]:
        """Servers this attempt must leave accepting, in first-touch order: each was sent a call other
        than a resume or a capabilities read, outside rollback and recovery."""
        out: list[str] = []
        for call in self.calls:
            if call.phase in COMPENSATING_PHASES or call.operation in ("resume", "capabilities", None):
                continue
            if call.server not in out:
                out.append(call.server)
        return out

    def started_phases(self) -> set[str]:
        return {span.phase for span in self.phases}

    def recovered(self) -> bool:
        return bool(self.recovery) or any(c.phase == "recovery" for c in self.calls)

    def intended(self, server: str, phase: str) -> bool:
        """The participation rule applied to this attempt (see `Cell.intended`)."""
        if phase in COMPENSATING_PHASES:
            if phase == "recovery" and not self.recovered():
                return False
            if phase == "rollback" and "rollback" not in self.started_phases():
                return False
            return server in self.touched()
        return server in self.participants and phase in self.started_phases()

    def matrix(self) -> dict[str, dict[str, Cell]]:
        """server -> phase -> `Cell`, for every server and every phase in `MATRIX_PHASES` used here."""
        servers = self.servers()
        phases = [
            p
            for p in MATRIX_PHASES
            if any(c.phase == p for c in self.calls) or any(self.intended(s, p) for s in servers)
        ]
        out: dict[str, dict[str, Cell]] = {}
        for server in servers:
            row: dict[str, Cell] = {}
            for phase in phases:
                calls = [c for c in self.calls if c.server == server and c.phase == phase]
                intended = self.intended(server, phase)
                compensated = sum(1 for c in calls if phase in COMPENSATING_PHASES and c.settles)
                state: str
                if calls:
                    last = calls[-1]
                    state = "compensated" if phase in COMPENSATING_PHASES and last.settles else last.outcome
                else:
                    state = "not sent" if intended else ""
                row[phase] = Cell(
                    intended=intended,
                    sent=len(calls),
                    acknowledged=sum(1 for c in calls if c.outcome == "acknowledged"),
                    failed=sum(1 for c in calls if c.outcome == "failed"),
                    unknown=sum(1 for c in calls if c.outcome == "unknown"),
                    compensated=compensated,
                    state=state,
                )
            out[server] = row
        return out

    def slowest_server(self) -> tuple[str, float] | None:
        """The server whose calls took longest in total (elapsed, or outcome time - sent time)."""
        totals: dict[str, float] = {}
        for call in self.calls:
            spent = call_duration(call)
            if spent is not None:
                totals[call.server] = totals.get(call.server, 0.0) + spent
        if not totals:
            return None
        name = max(totals, key=lambda s: (totals[s], s))
        return name, totals[name]

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "kind": self.kind,
            "outcome": self.outcome,
            "deadline_ts": self.deadline_ts,
            "participants": list(self.participants),
            "epoch": self.epoch,
            "started_seq": self.started_seq,
            "started_at": self.started_at,
            "terminal_seq": self.terminal_seq,
            "ended_at": self.terminal_at,
            "duration_s": self.duration_s,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "events": self.events,
            "abort_reason": self.abort_reason,
            "left_paused": list(self.left_paused),
            "not_paused": list(self.not_paused),
            "published_dir": self.published_dir,
            "calls": [c.to_json() for c in self.calls],
            "phases": [p.to_json() for p in self.phases],
            "matrix": {s: {p: c.to_json() for p, c in row.items()} for s, row in self.matrix().items()},
            "recovery": [r.to_json() for r in self.recovery],
            "pairing_errors": [{"seq": s, "message": m} for s, m in self.pairing_errors],
            # v1 attempts keep their shape: the plane and its facts are added for v2 only
            **({"plane": self.plane, "v2": self.v2.to_json()} if self.v2 is not None else {}),
            # and a v1 attempt's rollouts once it recorded them
            **({"rollouts": self.rollouts.to_json()} if self.rollouts is not None else {}),
        }


def call_duration(call: Call) -> float | None:
    """How long a call took: its recorded `elapsed_s`, else outcome time minus sent time."""
    if call.elapsed_s is not None:
        return max(0.0, call.elapsed_s)
    if call.outcome_ts is not None:
        return max(0.0, call.outcome_ts - call.sent_ts)
    return None


class AttemptBuilder:
    """Folds the events of one attempt, in seq order, into an `AttemptView`."""

    def __init__(self, checkpoint_id: str) -> None:
        self.view = AttemptView(checkpoint_id=checkpoint_id)
        self._open: dict[str, Call] = {}
        self._closed: set[str] = set()
        self._kinds: dict[str, str] = {}  # participant -> kind, as of the last discovery.completed

    def feed(self, event: Event) -> None:
        view = self.view
        if event.kind == "discovery.completed" and view.started_seq is None:
            self._kinds = {
                str(p.get("name")): str(p.get("component"))
                for p in event.data.get("participants") or ()
                if isinstance(p, Mapping)
            }
            return
        if event.checkpoint_id != view.checkpoint_id and not (
            event.kind == "recovery.completed" and view.checkpoint_id in _outcomes(event)
        ):
            return
        ts = parse_at(event.at)
        view.events += 1
        if view.first_seq is None:
            view.first_seq = event.seq
        view.last_seq = event.seq
        view.end_ts = ts if view.end_ts is None else max(view.end_ts, ts)
        if view.start_ts is None:
            view.start_ts = ts
        handler = _HANDLERS.get(event.kind)
        if handler is not None:
            handler(self, event, ts)

    # -- per kind ---------------------------------------------------------------------------

    def _started(self, event: Event, ts: float) -> None:
        view, data = self.view, event.data
        if view.started_seq is not None:
            return
        view.started_seq, view.started_at, view.start_ts = event.seq, event.at, ts
        view.kind = _str(data.get("kind"))
        view.deadline_ts = _float(data.get("deadline_ts"))
        parts = data.get("participants")
        view.participants = tuple(str(p) for p in parts) if isinstance(parts, list) else ()
        view.epoch = event.epoch
        if data.get("plane") == "v2":
            view.plane = "v2"
            view.v2 = V2Facts(
                stop=data.get("stop") is True,
                kinds={p: self._kinds[p] for p in view.participants if p in self._kinds},
            )

    def _phase_started(self, event: Event, ts: float) -> None:
        self.view.phases.append(PhaseSpan(str(event.data.get("phase", "")), event.seq, ts))

    def _phase_ended(self, event: Event, ts: float) -> None:
        name = str(event.data.get("phase", ""))
        for span in reversed(self.view.phases):
            if span.phase == name and span.status == "open":
                span.end_seq, span.end_ts = event.seq, ts
                if event.kind == "phase.completed":
                    span.status = "completed"
                else:
                    span.status = "failed"
                    span.reason = _str(event.data.get("reason"))
                return

    def _sent(self, event: Event, ts: float) -> None:
        data = event.data
        call_id = event.call_id or f"seq-{event.seq}"
        if call_id in self._open or call_id in self._closed:
            self.view.pairing_errors.append((event.seq, f"call_id {call_id} sent twice"))
            return
        path = str(data.get("path", ""))
        component, operation = classify_path(path)
        if self.view.v2 is not None and is_v2_path(path):
            component = self.view.v2.kinds.get(event.server or "")
            if operation == "renew":
                self.view.v2.renewals += 1
        call = Call(
            call_id=call_id,
            server=event.server or "?",
            phase=str(data.get("phase", "")),
            method=str(data.get("method", "")),
            path=path,
            url=str(data.get("url", "")),
            component=component,
            operation=operation,
            timeout_s=_float(data.get("timeout_s")),
            sent_seq=event.seq,
            sent_at=event.at,
            sent_ts=ts,
            epoch=event.epoch,
        )
        self._open[call_id] = call
        self.view.calls.append(call)

    def _outcome(self, event: Event, ts: float) -> None:
        call_id = event.call_id or ""
        call = self._open.pop(call_id, None)
        if call is None:
            why = "a second outcome" if call_id in self._closed else "an outcome with no call.sent"
            self.view.pairing_errors.append((event.seq, f"{why} for call_id {call_id}"))
            return
        self._closed.add(call_id)
        data = event.data
        call.outcome_seq, call.outcome_at, call.outcome_ts = event.seq, event.at, ts
        call.elapsed_s = _float(data.get("elapsed_s"))
        call.status = _int(data.get("status"))
        if event.kind == "call.replied":
            ok = call.status is not None and 200 <= call.status < 300
            call.outcome = "acknowledged" if ok else "failed"
            if not ok:
                call.error = "http"
                call.code = _error_code(data.get("body"))
            elif call.operation == "renew" and self.view.v2 is not None:
                body = data.get("body")
                lease = _float(body.get("lease_expires_at")) if isinstance(body, Mapping) else None
                if lease is not None:
                    last = self.view.v2.last_lease
                    self.view.v2.last_lease = lease if last is None else max(last, lease)
        else:
            call.outcome = "failed"
            call.error = _str(data.get("error"))
            call.code = _str(data.get("code"))
            call.detail = _str(data.get("detail"))

    def _settled(self, event: Event, ts: float) -> None:
        data = event.data
        self.view.recovery.append(
            Settled(
                seq=event.seq,
                at=event.at,
                ts=ts,
                epoch=event.epoch,
                server=event.server,
                reported_phase=_str(data.get("reported_phase")),
                active_checkpoint_id=_str(data.get("active_checkpoint_id")),
                action=_str(data.get("action")),
                result=_str(data.get("result")),
            )
        )

    def _terminal(self, event: Event, ts: float) -> None:
        view, data = self.view, event.data
        if view.terminal_seq is not None:
            # a restore ends `restored` (servers paused); the resume that finishes it later makes
            # its outcome `resumed`, as `quiesce history` says
            resumed = event.kind == "attempt.completed" and data.get("outcome") == "resumed"
            if view.outcome == "restored" and resumed:
                view.outcome = "resumed"
            return
        view.terminal_seq, view.terminal_at = event.seq, event.at
        if event.kind == "attempt.aborted":
            view.outcome = "aborted"
            view.abort_reason = _str(data.get("reason"))
            view.left_paused = tuple(str(s) for s in data.get("left_paused") or ())
            view.not_paused = tuple(str(s) for s in data.get("not_paused") or ())
        elif event.kind == "attempt.completed":
            view.outcome = _str(data.get("outcome")) or "completed"
        else:  # recovery.completed naming the attempt abandoned
            view.outcome = "abandoned"

    def _recovery_completed(self, event: Event, ts: float) -> None:
        if _outcomes(event).get(self.view.checkpoint_id) == "abandoned":
            self._terminal(event, ts)

    def _aborting(self, event: Event, ts: float) -> None:
        self.view.abort_reason = _str(event.data.get("reason"))

    def _publishing(self, event: Event, ts: float) -> None:
        self.view.publishing_seq = event.seq

    def _published(self, event: Event, ts: float) -> None:
        self.view.published_dir = _str(event.data.get("final_dir"))

    def _in_order(self, value: Any) -> dict[str, tuple[str, ...]]:
        """`_per_server(value)` with the participants first, in attempt order (the ledger stores
        its keys sorted)."""
        found = _per_server(value)
        order = {name: i for i, name in enumerate(self.view.participants)}
        return dict(sorted(found.items(), key=lambda item: (order.get(item[0], len(order)), item[0])))

    def _episodes(self, event: Event, ts: float) -> None:
        facts, data = self.view.v2, event.data
        if facts is None:
            return
        if event.kind == "episodes.blocked":
            facts.blockers = self._in_order(data.get("blockers"))
            counts = data.get("counts")
            if isinstance(counts, dict):
                facts.blocker_counts = {str(k): v for k, v in counts.items() if _int(v) is not None}
        elif event.kind == "episodes.scoped":
            facts.scope = _keys(data.get("scope"))
            facts.scope_source = _str(data.get("source"))
            facts.restarts = self._in_order(data.get("restarts"))
        elif event.kind == "episodes.exported":
            facts.exported = self._in_order(data.get("exported"))
        elif event.kind == "episodes.restored":
            facts.restored_from = _str(data.get("source_checkpoint_id"))
            facts.inventory = _keys(data.get("scope"))
            facts.restored = self._in_order(data.get("restored"))
        else:
            operation = episode_operation(event)
            if operation is not None:
                facts.operations.append(operation)

    def _rollouts(self, event: Event, ts: float) -> None:
        """v1's `rollouts.captured` / `rollouts.continued` (a v2 attempt records its episodes instead)."""
        view, data = self.view, event.data
        if view.v2 is not None:
            return
        facts = view.rollouts = view.rollouts if view.rollouts is not None else RolloutFacts()
        if event.kind == "rollouts.captured":
            facts.captured = self._pairs_in_order(data.get("captured"))
        elif event.kind == "rollouts.continued":
            facts.continued_from = _str(data.get("source_checkpoint_id"))
            facts.continued = self._pairs_in_order(data.get("continued"))
            facts.discarded = self._pairs_in_order(data.get("discarded"))
            unknown = data.get("unknown")
            if isinstance(unknown, Mapping):
                facts.unknown = {str(n): str(why) for n, why in unknown.items()}

    def _pairs_in_order(self, value: Any) -> dict[str, tuple[Pair, ...]]:
        """Per agent, its `(rollout_id, attempt)` pairs (`_pairs`), the participants first in
        attempt order (the ledger stores the keys sorted)."""
        found = {str(k): _pairs(v) for k, v in value.items()} if isinstance(value, Mapping) else {}
        order = {name: i for i, name in enumerate(self.view.participants)}
        return dict(sorted(found.items(), key=lambda item: (order.get(item[0], len(order)), item[0])))


def _outcomes(event: Event) -> dict[str, str]:
    outcomes = event.data.get("outcomes") if event.kind == "recovery.completed" else None
    if not isinstance(outcomes, dict):
        return {}
    return {str(k): str(v) for k, v in outcomes.items()}


_HANDLERS: Final = {
    "attempt.started": AttemptBuilder._started,
    "phase.started": AttemptBuilder._phase_started,
    "phase.completed": AttemptBuilder._phase_ended,
    "phase.failed": AttemptBuilder._phase_ended,
    "call.sent": AttemptBuilder._sent,
    "call.replied": AttemptBuilder._outcome,
    "call.failed": AttemptBuilder._outcome,
    "recovery.settled": AttemptBuilder._settled,
    "attempt.aborting": AttemptBuilder._aborting,
    "attempt.aborted": AttemptBuilder._terminal,
    "attempt.completed": AttemptBuilder._terminal,
    "attempt.publishing": AttemptBuilder._publishing,
    "attempt.published": AttemptBuilder._published,
    "recovery.completed": AttemptBuilder._recovery_completed,
    "episodes.blocked": AttemptBuilder._episodes,
    "episodes.scoped": AttemptBuilder._episodes,
    "episodes.exported": AttemptBuilder._episodes,
    "episodes.restored": AttemptBuilder._episodes,
    "episodes.retired": AttemptBuilder._episodes,
    "rollouts.forgotten": AttemptBuilder._episodes,
    "rollouts.captured": AttemptBuilder._rollouts,
    "rollouts.continued": AttemptBuilder._rollouts,
}


def build_attempt(checkpoint_id: str, events: Iterable[Event]) -> AttemptView:
    """The `AttemptView` of `checkpoint_id` from `events` (seq order; others ignored)."""
    builder = AttemptBuilder(checkpoint_id)
    for event in events:
        builder.feed(event)
    return builder.view
