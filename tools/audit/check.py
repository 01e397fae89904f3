"""The protocol check: from the events alone, did each attempt obey the protocol?

`ProtocolChecker` is fed events in seq order (the whole ledger, or the events of one attempt plus
every `coordinator.started`) and keeps a small state per attempt — its open calls, the ids of its
answered calls, a summary per server — never the events, so it streams over large ledgers.
`finish()` returns a `CheckReport`.

Rules (each `Violation` names the seq of the offending event):

- `order` — within one run of a phase (from its `phase.started`; calls made by another epoch are
  another run), calls follow the step order of `quiesce.coordinator.phases.ORDER` (rollback and recovery
  follow the resume order and may only resume; a phase that resumes (rollback, recovery, resume)
  may also read capabilities — recovery settles each server by them, and a resume waits on them
  while an operation of the attempt still runs on the server; a prepare may
  read an agent's status — which executions it holds unacknowledged — as part of that agent's
  prepare step): a call of an earlier step after a later one, a call of an operation the phase
  does not have, and a call sent while a call of an earlier step of the same run has no outcome
  yet are violations.
- `unsettled` — when a save attempt has ended (a terminal event), every server it touched (sent
  anything but a resume, outside rollback/recovery, that the server did not refuse before running
  it — `quiesce.coordinator.protocol.refused_before_effect`: a wrong token, another checkpoint id active;
  such a request paused nothing) was either committed and then resumed, or
  compensated: resumed in rollback or recovery — or in any phase once the attempt was aborted (a
  later `quiesce resume` of what a rollback left paused) — after its last touch (a 409
  `invalid_phase` to such a resume means it never paused, which settles it too). A touched server
  that was never sent such a resume is a violation at the terminal event — unless recovery found it
  held by another checkpoint id and left it alone (a warning); one that was sent
  resumes, none of which settled it, is only a warning (`left_paused`: the coordinator did its
  part, the server did not answer). A save attempt resumed in its `resume` phase without an
  acknowledged commit (and before any abort) is a violation at that resume — unless it is a
  drain-only policy model (its `mode` in the last `discovery.completed` is not `export_restore`:
  it never commits) resumed after another server's acknowledged commit or the publication, or a later
  coordinator recorded the attempt's publication before it (`attempt.published` of a later epoch
  than `attempt.started`: recovery found the renamed snapshot on disk, its manifest naming this
  checkpoint id, after a power failure took the write-behind records of the commits with it).
  Restore attempts stay paused by design until resumed; once one records the outcome `resumed`,
  every server it touched must have been resumed. An attempt is judged as of its last terminal
  event; attempts with none are reported as open, not judged.
- `deadline` — no call is sent (by its `call.sent` `at`) after the attempt's `deadline_ts`, except
  resumes, the capabilities reads of a phase that resumes, recovery's calls, and any call a later
  epoch (a recovering coordinator, which works to its own budget, e.g. re-driving an interrupted
  restore) sends for the attempt. Resumes are exempt in every phase, not only in rollback and
  recovery: a resume only releases a server, and the coordinator gives each role group the budget
  `max(deadline_ts, now + control_timeout_s)`
  (Gym control plane v1's order) — the resume of a restore comes whenever the caller asks for it, and a
  published save's resume may be retried later. A run of a phase whose `phase.started` records
  its own `deadline_ts` (a restore re-driven under its id) is judged against that budget instead.
- `epoch` — no event carries an epoch lower than one already seen at a smaller seq.
- `pairing` — every outcome follows its `call.sent`, once (a second `call.sent` with one id too).
- `commit` / `restore` (v1; v2 has its own, see `check_v2`) — every commit (restore) of an attempt
  names the same `checkpoint_dir` but for each server's own `folder` (discovery's) at its end, and
  a server with a folder is sent one that ends with it; a policy model's commit carries exactly the
  continuation indexes the agents of its folder replied with in this attempt (the servers of one
  folder are one Gym deployment: a model is never handed another's rollouts). A request whose body
  the ledger capped is not judged by these.

Gym's unified plane (v2: `attempt.started {plane: v2}`, or a call on its routes): `order` is not
judged — the v2 rules of `check_v2` are (stage order, same id, commit, scope, renew, publish,
stop, restore, all or nothing, retire order, no retire or forget while a save is open).
`unsettled` reads v2's replies: a request refused before it ran is
`quiesce.coordinator.protocol_v2.refused_before_effect`'s, a resume refused with 409
`checkpoint_conflict` (another id holds the server) settles it, a published stop-checkpoint
leaves its servers paused by design. `deadline` exempts v2's renewals (they keep a caller's
block that outlasts the deadline paused), retires and forgets (they have budgets of their own)
and status reads where capabilities reads are exempt.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal

from quiesce.coordinator import protocol_v2
from quiesce.coordinator.phases import ORDER, Role, resume_order
from quiesce.coordinator.protocol import AGENT, INVALID_PHASE, MODEL, RESOURCES, refused_before_effect
from quiesce.ledger.events import Event
from quiesce.ledger.replay import Difference
from quiesce.tools.audit.attempts import (
    COMPENSATING_PHASES,
    EPISODE_OPERATIONS,
    classify_path,
    is_v2_path,
    parse_at,
)
from quiesce.tools.audit.check_v2 import V2_RULES, Operations, V2Attempt, V2Rule

Rule = Literal["order", "unsettled", "deadline", "epoch", "pairing"] | V2Rule
RULES: Final[tuple[Rule, ...]] = ("order", "unsettled", "deadline", "epoch", "pairing", *V2_RULES)
#: v2 operations a save's deadline does not bind (see the module docstring).
_V2_UNBOUND: Final = frozenset({"renew", "retire", "forget"})

_ROLE_OF_COMPONENT: Final[dict[str, Role]] = {MODEL: "policy", AGENT: "agent", RESOURCES: "resources"}
#: phase -> (role, operation) -> step index, from the coordinator's order table.
_RANKS: Final[dict[str, dict[tuple[str, str], int]]] = {
    phase: {(step.role, step.operation): i for i, step in enumerate(order)} for phase, order in ORDER.items()
}
_RESUME_RANK: Final[dict[str, int]] = {role: i for i, role in enumerate(resume_order())}
#: Phases that resume servers: they may read capabilities, and a read there — like the resume it
#: waits for — is not bound by the attempt's deadline (a resume only releases a server).
_LETTING_GO: Final = frozenset({"rollback", "recovery", "resume"})
#: Reads that belong to another step of their phase: the agent status read while an agent prepares.
_READ_AS: Final[dict[tuple[str, str, str], tuple[str, str]]] = {
    ("prepare", "agent", "status"): ("agent", "prepare"),
}


@dataclass(frozen=True, slots=True)
class Violation:
    """One breach of a rule, at the seq of the event that shows it."""

    seq: int
    rule: str
    checkpoint_id: str | None
    server: str | None
    message: str
    #: the rollout a lineage rule (`lineage-*`, `quiesce.ledger.lineage`) names
    rollout_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "seq": self.seq,
            "rule": self.rule,
            "checkpoint_id": self.checkpoint_id,
            "server": self.server,
            "message": self.message,
        }
        if self.rollout_id is not None:
            out["rollout_id"] = self.rollout_id
        return out


@dataclass(frozen=True, slots=True)
class ChainVerdict:
    """What a check verified of the hash chain, and what it found.

    `scope`: `chain` — every row from seq 1 to the head, each linked to the one before and its
    hash recomputed from its content, and no seq recorded past the head; `rows` — each row read
    (one attempt's) recomputed from its own content, links to the rows between them not checked;
    `none` — not verified. `ok` is None when nothing was verified.
    """

    scope: Literal["chain", "rows", "none"] = "none"
    ok: bool | None = None
    first_bad_seq: int | None = None
    problem: str | None = None
    rows: int = 0

    def describe(self) -> str:
        if self.scope == "none":
            return "hash chain: NOT verified"
        if self.ok is False:
            return f"hash chain: BROKEN at seq {self.first_bad_seq}: {self.problem}"
        if self.scope == "chain":
            return (
                f"hash chain: verified, seq 1 to {self.rows} (every link and every row's hash recomputed"
                " from its content)"
            )
        return (
            f"hash chain: each of these {self.rows} events recomputes from its own content; their links"
            " to the rest of the chain are NOT verified here (`quiesce check` without an id, or"
            " `quiesce replay --verify`, verifies the whole chain)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "verified": self.scope,
            "ok": self.ok,
            "first_bad_seq": self.first_bad_seq,
            "problem": self.problem,
            "rows": self.rows,
        }


@dataclass(slots=True)
class ProjectionVerdict:
    """The `attempts` projection (what `history`, `status` and the service show) against a fold of
    the events: `rows` live rows compared, every differing column named. `verified` is False when
    nothing was compared (`ok` is then None)."""

    verified: bool = False
    rows: int = 0
    differences: list[Difference] = field(default_factory=list)

    @property
    def ok(self) -> bool | None:
        return not self.differences if self.verified else None

    def describe(self) -> str:
        if not self.verified:
            return "projection: NOT compared"
        if not self.differences:
            return f"projection: matches the events ({self.rows} attempt row{'' if self.rows == 1 else 's'})"
        return (
            f"projection: DIFFERS from the events in {len(self.differences)} place"
            f"{'' if len(self.differences) == 1 else 's'} (edited by hand?): `quiesce replay --rebuild`"
            " rebuilds it from the events once the chain is verified"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "verified": self.verified,
            "ok": self.ok,
            "rows": self.rows,
            "differences": [asdict(d) for d in self.differences],
        }


@dataclass(slots=True)
class CheckReport:
    """The result of a check. `ok` is true when there is no violation (warnings do not count), the
    hash chain, as far as it was verified (`chain`), holds and the projection, where compared,
    matches the events."""

    violations: list[Violation] = field(default_factory=list)
    warnings: list[Violation] = field(default_factory=list)
    attempts: dict[str, str] = field(default_factory=dict)  # checkpoint id -> "judged" | "open"
    events: int = 0
    chain: ChainVerdict = field(default_factory=ChainVerdict)
    projection: ProjectionVerdict = field(default_factory=ProjectionVerdict)
    #: the rollout lineage, when checked (a ledger-wide check): rollouts per state
    rollouts: dict[str, int] | None = None

    @property
    def ok(self) -> bool:
        return not self.violations and self.chain.ok is not False and self.projection.ok is not False

    def for_attempt(self, checkpoint_id: str) -> CheckReport:
        return CheckReport(
            violations=[v for v in self.violations if v.checkpoint_id == checkpoint_id],
            warnings=[v for v in self.warnings if v.checkpoint_id == checkpoint_id],
            attempts={k: v for k, v in self.attempts.items() if k == checkpoint_id},
            events=self.events,
            chain=self.chain,
            projection=self.projection,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "events": self.events,
            "chain": self.chain.to_json(),
            "projection": self.projection.to_json(),
            "attempts": dict(sorted(self.attempts.items())),
            "violations": [v.to_json() for v in self.violations],
            "warnings": [v.to_json() for v in self.warnings],
            **({"rollouts": self.rollouts} if self.rollouts is not None else {}),
        }


@dataclass(slots=True)
class _Open:
    """A sent call still waiting for its outcome."""

    server: str
    phase: str
    operation: str | None
    run: tuple[str, int, int]
    rank: int | None
    sent_seq: int
    v2: bool = False
    component: str | None = None


@dataclass(slots=True)
class _Server:
    touches: list[int] = field(default_factory=list)  # sent seqs of its requests that may pause it
    refused: set[int] = field(default_factory=set)  # ... of those refused before they ran
    commit_ack_seq: int | None = None  # sent seq of the last acknowledged commit
    last_resume_sent_seq: int | None = None
    settle_seq: int | None = None  # sent seq of the last resume that settled the server
    settle_compensating: bool = False
    other_checkpoint_seq: int | None = None  # recovery found it held by another checkpoint id

    @property
    def last_touch_seq(self) -> int | None:
        """The last request that may have paused it: one the server refused before it ran (a
        wrong token, another checkpoint id active) paused nothing, so it is no touch."""
        return max((seq for seq in self.touches if seq not in self.refused), default=None)


@dataclass(slots=True)
class _Attempt:
    checkpoint_id: str
    kind: str | None = None
    epoch: int | None = None  # the epoch that started the attempt
    started_seq: int | None = None
    deadline_ts: float | None = None
    terminal_seq: int | None = None  # the last terminal event
    outcomes: set[str] = field(default_factory=set)  # every terminal outcome recorded
    abort_seq: int | None = None  # the first attempt.aborting / attempt.aborted
    recovered_publication_seq: int | None = None  # the first attempt.published of a later epoch
    published_seq: int | None = None  # the first attempt.published
    drain_only: frozenset[str] = frozenset()  # participants that never commit (as discovered before it)
    open: dict[str, _Open] = field(default_factory=dict)
    closed: set[str] = field(default_factory=set)
    # (phase, epoch) -> number of the current run of that phase (bumped by each phase.started)
    runs: dict[tuple[str, int], int] = field(default_factory=dict)
    # (phase, epoch, run) -> highest step rank sent in that run
    run_max: dict[tuple[str, int, int], int] = field(default_factory=dict)
    # (phase, epoch) -> the budget the current run of that phase recorded in its `phase.started`
    run_deadline: dict[tuple[str, int], float] = field(default_factory=dict)
    servers: dict[str, _Server] = field(default_factory=dict)
    v2: V2Attempt | None = None  # an attempt on Gym's unified plane: its rules' state
    folders: dict[str, str] = field(default_factory=dict)  # participant -> its folder (discovery's)
    # v1: operation -> (the checkpoint_dir without the server's folder, the first server sent it)
    dirs: dict[str, tuple[str, str]] = field(default_factory=dict)
    # v1: agent -> (relative_path, sha256) of the continuation index its acknowledged commit replied
    indexes: dict[str, tuple[str, str]] = field(default_factory=dict)

    def server(self, name: str) -> _Server:
        found = self.servers.get(name)
        if found is None:
            found = self.servers[name] = _Server()
        return found


def _rank(phase: str, component: str | None, operation: str | None) -> int | None:
    """The step index of a call within its phase; None when the phase has no such step."""
    role = _ROLE_OF_COMPONENT.get(component or "")
    if role is None or operation is None:
        return None
    if phase in COMPENSATING_PHASES:
        return _RESUME_RANK.get(role) if operation == "resume" else None
    step = _READ_AS.get((phase, role, operation), (role, operation))
    return _RANKS.get(phase, {}).get(step)


def _index_key(ref: Any) -> tuple[str, str]:
    """An artifact reference as the `commit` rule compares them: (relative_path, sha256)."""
    if not isinstance(ref, dict):
        return ("", repr(ref))
    return (str(ref.get("relative_path")), str(ref.get("sha256")))


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class ProtocolChecker:
    """Streams events (seq order) and reports protocol violations; see the module docstring."""

    def __init__(self) -> None:
        self._report = CheckReport()
        self._attempts: dict[str, _Attempt] = {}
        self._max_epoch: int | None = None
        self._max_epoch_seq: int | None = None
        self._drain_only: frozenset[str] = frozenset()  # as of the last discovery.completed
        self._kinds: dict[str, str] = {}  # participant -> component, as of the last discovery.completed
        self._folders: dict[str, str] = {}  # participant -> its folder in a snapshot (v2), the same
        self._open_saves: dict[str, int] = {}  # save attempts with no terminal event -> started seq
        self._operations = Operations()  # retires and forgets outside any attempt

    def _violation(self, seq: int, rule: Rule, attempt: str | None, server: str | None, msg: str) -> None:
        self._report.violations.append(Violation(seq, rule, attempt, server, msg))

    def feed(self, event: Event) -> None:
        self._report.events += 1
        self._check_epoch(event)
        cid = event.checkpoint_id
        if event.kind == "recovery.completed":
            outcomes = event.data.get("outcomes")
            if isinstance(outcomes, dict):
                for key, value in outcomes.items():
                    found = self._attempts.get(str(key))
                    if found is not None and value == "abandoned":
                        found.terminal_seq = event.seq
                        found.outcomes.add("abandoned")
                        self._open_saves.pop(str(key), None)
        if event.kind == "discovery.completed":
            participants = [p for p in event.data.get("participants", []) if isinstance(p, dict)]
            self._drain_only = frozenset(
                str(p.get("name")) for p in participants if p.get("mode") not in (None, "export_restore")
            )
            self._kinds = {str(p.get("name")): str(p.get("component")) for p in participants}
            self._folders = {
                str(p.get("name")): str(p.get("folder") or "") for p in participants if p.get("folder")
            }
        if cid is None:
            self._outside(event)
            return
        attempt = self._attempts.get(cid)
        if attempt is None:
            attempt = self._attempts[cid] = _Attempt(cid)
        kind = event.kind
        if kind == "attempt.started" and attempt.kind is not None and event.data.get("plane") == "v2":
            self._violation(
                event.seq,
                "restore" if event.data.get("kind") == "restore" else "same_id",
                cid,
                None,
                f"an attempt started again under the id of the attempt started at seq {attempt.started_seq}",
            )
        if kind == "attempt.started" and attempt.kind is None:
            data = event.data
            attempt.kind = data.get("kind") if isinstance(data.get("kind"), str) else None
            attempt.epoch = event.epoch
            attempt.started_seq = event.seq
            attempt.drain_only = self._drain_only
            attempt.folders = dict(self._folders)
            deadline = data.get("deadline_ts")
            if isinstance(deadline, int | float) and not isinstance(deadline, bool):
                attempt.deadline_ts = float(deadline)
            if attempt.kind == "save":
                self._open_saves[cid] = event.seq
            if data.get("plane") == "v2":
                self._start_v2(attempt, event)
        if attempt.v2 is not None and kind not in ("call.sent", "call.replied", "call.failed"):
            attempt.v2.event(self._violation, event.seq, kind, event.epoch, event.data)
        if kind == "attempt.started":
            pass
        elif kind == "phase.started":
            key = (str(event.data.get("phase", "")), event.epoch)
            attempt.runs[key] = attempt.runs.get(key, 0) + 1
            own = event.data.get("deadline_ts")
            if isinstance(own, int | float) and not isinstance(own, bool):
                attempt.run_deadline[key] = float(own)
            else:
                attempt.run_deadline.pop(key, None)
        elif kind == "call.sent":
            self._sent(attempt, event)
        elif kind in ("call.replied", "call.failed"):
            self._outcome(attempt, event)
        elif kind in ("attempt.aborted", "attempt.completed"):
            self._open_saves.pop(cid, None)
            attempt.terminal_seq = event.seq
            outcome = event.data.get("outcome") if kind == "attempt.completed" else "aborted"
            attempt.outcomes.add(outcome if isinstance(outcome, str) else "completed")
            if kind == "attempt.aborted" and attempt.abort_seq is None:
                attempt.abort_seq = event.seq
        elif kind == "attempt.aborting" and attempt.abort_seq is None:
            attempt.abort_seq = event.seq
        elif kind == "attempt.published":
            if attempt.published_seq is None:
                attempt.published_seq = event.seq
            if (
                attempt.recovered_publication_seq is None
                and attempt.epoch is not None
                and event.epoch > attempt.epoch
            ):
                attempt.recovered_publication_seq = event.seq
        elif kind == "recovery.settled" and event.server and event.data.get("result") == "other_checkpoint":
            attempt.server(event.server).other_checkpoint_seq = event.seq

    def _start_v2(self, attempt: _Attempt, event: Event) -> None:
        """The v2 rules' state of an attempt on Gym's unified plane; a restore's id must be new."""
        data = event.data
        parts = data.get("participants")
        names = tuple(str(p) for p in parts) if isinstance(parts, list) else ()
        source = data.get("source_checkpoint_id")
        attempt.v2 = V2Attempt(
            checkpoint_id=attempt.checkpoint_id,
            kind=str(attempt.kind),
            epoch=event.epoch,
            stop=data.get("stop") is True,
            participants=names,
            kinds={n: self._kinds[n] for n in names if n in self._kinds},
            folders={n: self._folders[n] for n in names if n in self._folders},
            source=source if isinstance(source, str) else None,
        )
        if attempt.kind == "restore" and source == attempt.checkpoint_id:
            self._violation(
                event.seq,
                "restore",
                attempt.checkpoint_id,
                None,
                "a restore under its snapshot's own checkpoint id",
            )

    def _during_save(self, event: Event, operation: str) -> None:
        """`retire_during_save`: a retire or forget sent while a save of this ledger is open."""
        open_saves = [(cid, seq) for cid, seq in self._open_saves.items() if cid != event.checkpoint_id]
        if open_saves:
            cid, seq = open_saves[0]
            self._violation(
                event.seq,
                "retire_during_save",
                event.checkpoint_id,
                event.server,
                f"{operation} sent while save {cid} (started at seq {seq}) was open",
            )

    def _outside(self, event: Event) -> None:
        """Calls recorded outside any attempt: the retires and forgets of Gym's unified plane."""
        call_id = event.call_id or f"seq-{event.seq}"
        if event.kind == "call.sent":
            path = str(event.data.get("path", ""))
            _, operation = classify_path(path)
            if is_v2_path(path) and operation in EPISODE_OPERATIONS:
                server = event.server or "?"
                self._during_save(event, operation)
                self._operations.sent(
                    self._violation,
                    event.seq,
                    server,
                    call_id,
                    operation,
                    self._kinds.get(server),
                    event.data,
                )
        elif event.kind in ("call.replied", "call.failed"):
            self._operations.outcome(call_id)

    def _check_epoch(self, event: Event) -> None:
        if self._max_epoch is not None and event.epoch < self._max_epoch:
            self._violation(
                event.seq,
                "epoch",
                event.checkpoint_id,
                event.server,
                f"{event.kind} written by epoch {event.epoch} after epoch {self._max_epoch} "
                f"appeared (seq {self._max_epoch_seq})",
            )
        elif self._max_epoch is None or event.epoch > self._max_epoch:
            self._max_epoch, self._max_epoch_seq = event.epoch, event.seq

    def _sent(self, attempt: _Attempt, event: Event) -> None:
        data = event.data
        call_id = event.call_id or f"seq-{event.seq}"
        server = event.server or "?"
        cid = attempt.checkpoint_id
        if call_id in attempt.open or call_id in attempt.closed:
            self._violation(event.seq, "pairing", cid, server, f"call_id {call_id} sent twice")
            return
        phase = str(data.get("phase", ""))
        path = str(data.get("path", ""))
        component, operation = classify_path(path)
        v2 = attempt.v2 is not None or is_v2_path(path)
        rank = None if v2 else _rank(phase, component, operation)
        run = (phase, event.epoch, attempt.runs.get((phase, event.epoch), 0))
        compensating = phase in COMPENSATING_PHASES

        # order (v1), or the v2 rules
        if v2:
            if attempt.v2 is not None:
                attempt.v2.sent(self._violation, event.seq, server, call_id, operation, phase, run, data)
            if operation in EPISODE_OPERATIONS:
                self._during_save(event, operation)
        elif rank is None:
            allowed = phase in _LETTING_GO and operation == "capabilities"
            if not allowed:
                what = f"{operation or data.get('path')} on {component or 'an unknown component'}"
                self._violation(event.seq, "order", cid, server, f"{what} is not a step of phase {phase!r}")
        else:
            highest = attempt.run_max.get(run)
            if highest is not None and rank < highest:
                self._violation(
                    event.seq, "order", cid, server, f"{operation} sent after a later step of phase {phase!r}"
                )
            else:
                attempt.run_max[run] = rank
            for other_id, other in attempt.open.items():
                if other.run == run and other.rank is not None and other.rank < rank:
                    self._violation(
                        event.seq,
                        "order",
                        cid,
                        server,
                        f"{operation} sent while {other.operation} to {other.server} (call {other_id}, "
                        f"seq {other.sent_seq}) of an earlier step of phase {phase!r} had no outcome",
                    )
                    break

        if not v2 and operation in ("commit", "restore") and isinstance(data.get("body"), dict):
            self._v1_folder(attempt, event.seq, server, component, operation, data["body"])

        # deadline
        # A later coordinator acting on this attempt (recovery) works to its own budget.
        by_recovery = attempt.epoch is not None and event.epoch > attempt.epoch
        exempt = (
            operation == "resume"
            or (operation == "capabilities" and phase in _LETTING_GO)
            or phase == "recovery"
            or by_recovery
            or (v2 and (operation in _V2_UNBOUND or (operation == "status" and phase in _LETTING_GO)))
        )
        deadline = attempt.run_deadline.get((phase, event.epoch), attempt.deadline_ts)
        if deadline is not None and not exempt:
            sent_ts = parse_at(event.at)
            if sent_ts > deadline:
                self._violation(
                    event.seq,
                    "deadline",
                    cid,
                    server,
                    f"{phase} {operation} sent {sent_ts - deadline:.3f}s after the deadline",
                )

        # settlement bookkeeping
        state = attempt.server(server)
        if operation == "resume":
            state.last_resume_sent_seq = event.seq
        elif not compensating and operation not in (None, "capabilities", *(("status",) if v2 else ())):
            state.touches.append(event.seq)
        attempt.open[call_id] = _Open(server, phase, operation, run, rank, event.seq, v2, component)

    def _v1_folder(
        self,
        attempt: _Attempt,
        seq: int,
        server: str,
        component: str | None,
        operation: str,
        body: dict[str, Any],
    ) -> None:
        """v1's `commit` and `restore` rules (module docstring) for one request sent."""
        cid = attempt.checkpoint_id
        rule: Rule = "commit" if operation == "commit" else "restore"
        own = attempt.folders.get(server, "")
        folder = body.get("checkpoint_dir")
        if isinstance(folder, str):
            if own and not folder.endswith(f"/{own}"):
                self._violation(
                    seq,
                    rule,
                    cid,
                    server,
                    f"{operation} sent with checkpoint_dir {folder!r}, not in its folder {own!r}",
                )
            base = folder[: -len(own) - 1] if own and folder.endswith(f"/{own}") else folder
            first = attempt.dirs.setdefault(operation, (base, server))
            if first[0] != base:
                self._violation(
                    seq,
                    rule,
                    cid,
                    server,
                    f"{operation} sent into {base!r} (its own folder aside), but {first[1]} got {first[0]!r}",
                )
        sent = body.get("continuation_indexes")
        if operation == "commit" and component == MODEL and isinstance(sent, list):
            mine = sorted(
                ref for agent, ref in attempt.indexes.items() if attempt.folders.get(agent, "") == own
            )
            if sorted(_index_key(ref) for ref in sent) != mine:
                where = f"folder {own!r}" if own else "its folder"
                self._violation(
                    seq,
                    "commit",
                    cid,
                    server,
                    f"model commit carries {len(sent)} continuation index(es), not exactly the {len(mine)}"
                    f" the agents of {where} committed: a model is handed its own deployment's indexes only",
                )

    def _outcome(self, attempt: _Attempt, event: Event) -> None:
        call_id = event.call_id or ""
        call = attempt.open.pop(call_id, None)
        if call is None:
            why = "a second outcome" if call_id in attempt.closed else "an outcome with no call.sent"
            self._violation(event.seq, "pairing", attempt.checkpoint_id, event.server, f"{why} for {call_id}")
            return
        attempt.closed.add(call_id)
        status = _int(event.data.get("status"))
        acknowledged = event.kind == "call.replied" and status is not None and 200 <= status < 300
        code = event.data.get("code")
        if event.kind == "call.replied":
            body = event.data.get("body")
            error = body.get("error") if isinstance(body, dict) else None
            code = error.get("code") if isinstance(error, dict) else None
        state = attempt.server(call.server)
        v2 = attempt.v2 is not None or call.v2
        if attempt.v2 is not None:
            reply = event.data.get("body") if event.kind == "call.replied" else None
            attempt.v2.outcome(self._violation, event.seq, call_id, acknowledged, reply)
        if call.operation == "commit" and acknowledged:
            state.commit_ack_seq = call.sent_seq
            reply = event.data.get("body")
            if (
                not v2
                and call.component == AGENT
                and isinstance(reply, dict)
                and "continuation_index" in reply
            ):
                attempt.indexes[call.server] = _index_key(reply["continuation_index"])
        refused = protocol_v2.refused_before_effect if v2 else refused_before_effect
        if call.sent_seq in state.touches and refused(status, code):
            state.refused.add(call.sent_seq)
        never_paused = protocol_v2.CHECKPOINT_CONFLICT if v2 else INVALID_PHASE
        settles = call.operation == "resume" and (acknowledged or (status == 409 and code == never_paused))
        if settles and (state.settle_seq is None or call.sent_seq > state.settle_seq):
            state.settle_seq = call.sent_seq
            after_abort = attempt.abort_seq is not None and call.sent_seq > attempt.abort_seq
            state.settle_compensating = call.phase in COMPENSATING_PHASES or after_abort

    def finish(self) -> CheckReport:
        """Judge every attempt with everything fed so far and return the report."""
        report = self._report
        for cid, attempt in self._attempts.items():
            if attempt.kind is None:
                continue  # events naming an id that never started: nothing to judge
            if attempt.terminal_seq is None:
                report.attempts[cid] = "open"
                continue
            report.attempts[cid] = "judged"
            if attempt.v2 is not None:
                attempt.v2.judge(self._violation, attempt.terminal_seq)
            if attempt.kind == "save":
                if attempt.v2 is not None and attempt.v2.stop and attempt.v2.published_seq is not None:
                    continue  # a published stop-checkpoint leaves its servers paused by design
                self._judge_save(attempt)
            elif "resumed" in attempt.outcomes:
                self._judge_resumed_restore(attempt)
        report.violations.sort(key=lambda v: (v.seq, v.rule))
        report.warnings.sort(key=lambda v: (v.seq, v.rule))
        return report

    def _unsettled(self, attempt: _Attempt, name: str, state: _Server) -> None:
        assert attempt.terminal_seq is not None
        touched = state.last_touch_seq
        tried = (
            state.last_resume_sent_seq is not None
            and touched is not None
            and (state.last_resume_sent_seq > touched)
        )
        held = state.other_checkpoint_seq
        if held is not None and (touched is None or held > touched):
            self._report.warnings.append(
                Violation(
                    attempt.terminal_seq,
                    "unsettled",
                    attempt.checkpoint_id,
                    name,
                    f"held by another checkpoint id when recovery settled it (seq {held}); left alone",
                )
            )
        elif tried:
            self._report.warnings.append(
                Violation(
                    attempt.terminal_seq,
                    "unsettled",
                    attempt.checkpoint_id,
                    name,
                    f"left paused: resumed (last at seq {state.last_resume_sent_seq}) but no resume "
                    "was acknowledged",
                )
            )
        else:
            self._violation(
                attempt.terminal_seq,
                "unsettled",
                attempt.checkpoint_id,
                name,
                f"touched at seq {touched}, never resumed afterwards",
            )

    def _judge_save(self, attempt: _Attempt) -> None:
        for name, state in attempt.servers.items():
            touched = state.last_touch_seq
            if touched is None:
                continue
            settled = state.settle_seq is not None and state.settle_seq > touched
            if not settled:
                self._unsettled(attempt, name, state)
                continue
            assert state.settle_seq is not None
            committed = state.commit_ack_seq is not None and state.commit_ack_seq < state.settle_seq
            recovered = attempt.recovered_publication_seq
            committed = committed or (recovered is not None and recovered < state.settle_seq)
            if name in attempt.drain_only:  # it never commits: the others' commit, or the publication
                others = [s.commit_ack_seq for s in attempt.servers.values() if s.commit_ack_seq is not None]
                published = attempt.published_seq
                committed = committed or any(seq < state.settle_seq for seq in others)
                committed = committed or (published is not None and published < state.settle_seq)
            if not state.settle_compensating and not committed:
                self._violation(
                    state.settle_seq,
                    "unsettled",
                    attempt.checkpoint_id,
                    name,
                    "resumed in the resume phase without an acknowledged commit (should be a rollback)",
                )

    def _judge_resumed_restore(self, attempt: _Attempt) -> None:
        for name, state in attempt.servers.items():
            touched = state.last_touch_seq
            if touched is not None and not (state.settle_seq is not None and state.settle_seq > touched):
                self._unsettled(attempt, name, state)


def check_events(events: Iterable[Event]) -> CheckReport:
    """Run the protocol check over `events` (seq order)."""
    checker = ProtocolChecker()
    for event in events:
        checker.feed(event)
    return checker.finish()
