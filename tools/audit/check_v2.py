"""The protocol rules of Gym's unified checkpoint plane (v2), judged from a ledger's events.

`ProtocolChecker` (`check.py`) feeds each v2 attempt's events to its `V2Attempt`, and the retires
and forgets recorded outside any attempt to `Operations`; v1's rules `order` never applies to v2
(its `unsettled`, `deadline`, `epoch` and `pairing` do). Stages: environment → model → agent →
resources, each participant's kind read from the last `discovery.completed` before the attempt.

Rules (each violation names the seq, the server and the rule):

- `stage_order` — no prepare to a later stage before every server of each earlier stage answered
  `prepared`; resumes (resume, rollback, recovery) run the stages backwards.
- `same_id` — every request of an attempt carries its checkpoint id (a prepare is asked again only
  with the same id).
- `commit` — commit only once every participant answered `prepared`; the same `checkpoint_dir`
  (each server's `folder` inside it, as discovery recorded it), scope and `stop` (the attempt's)
  to all; no scope only to an environment server committed first, before a scope is recorded,
  and only when that scope is then `derived`.
- `scope` — the recorded scope (`episodes.scoped`) leaves out every restart reported (prepare
  replies, `episodes.scoped.restarts`); every commit's `episode_ids` and every export
  (`episodes.exported`) lie within it (an environment's derived export may also hold restarts).
- `renew` — only to a server already sent its prepare, before the attempt ended, never after a
  resume of that server.
- `publish` — `attempt.publishing` only once every participant's commit replied `committed`.
- `stop` — a stop-checkpoint, once published, resumes nobody and ends `attempt.completed
  {servers: [], outcome: published}`.
- `restore` — a restore has an id new to the ledger (not its snapshot's); every participant gets
  the same folder (its own `folder` inside it) and inventory, and a finished restore has every
  participant `restored` from the snapshot's checkpoint.
- `all_or_nothing` — a failed restore retires the next attempts of its inventory on every
  participant, then resumes every participant, and ends `attempt.aborted`.
- `retire_order` — retire and forget reach callers before callees: environment → agent →
  {model, resources}, no stage before the earlier stage's calls have their outcome.
- `retire_during_save` — no retire or forget is sent while a save of this ledger is open
  (judged by `ProtocolChecker`, which sees every attempt).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from quiesce.tools.audit.attempts import capture_key, next_attempt_key

V2Rule = Literal[
    "stage_order",
    "same_id",
    "commit",
    "scope",
    "renew",
    "publish",
    "stop",
    "restore",
    "all_or_nothing",
    "retire_order",
    "retire_during_save",
]
V2_RULES: Final[tuple[V2Rule, ...]] = (
    "stage_order",
    "same_id",
    "commit",
    "scope",
    "renew",
    "publish",
    "stop",
    "restore",
    "all_or_nothing",
    "retire_order",
    "retire_during_save",
)
#: (seq, rule, checkpoint id, server, message) -> recorded as a violation.
Report = Callable[[int, V2Rule, str | None, str | None, str], None]

#: Gym's prepare stages (resume runs them backwards).
STAGE: Final[Mapping[str, int]] = {"environment": 0, "model": 1, "agent": 2, "resources": 3}
#: Gym's retire/forget order: callers before callees, model and resources together.
RETIRE_GROUP: Final[Mapping[str, int]] = {"environment": 0, "agent": 1, "model": 2, "resources": 2}
#: Phases that resume servers.
RESUMING: Final = frozenset({"resume", "rollback", "recovery"})


def _keys(episodes: Any) -> frozenset[str] | None:
    """The capture keys of a body's `episode_ids` (None when the body sends none)."""
    if not isinstance(episodes, list):
        return None
    return frozenset(k for k in (capture_key(e) for e in episodes) if k is not None)


def _named(keys: set[str] | frozenset[str], limit: int = 5) -> str:
    ordered = sorted(keys)
    more = len(ordered) - limit
    return ", ".join(ordered[:limit]) + (f" and {more} more" if more > 0 else "")


def _body(data: Mapping[str, Any]) -> Mapping[str, Any]:
    body = data.get("body")
    return body if isinstance(body, Mapping) else {}


@dataclass(slots=True)
class _Sent:
    server: str
    operation: str
    phase: str
    run: tuple[str, int, int]
    rank: int | None
    seq: int
    body: Mapping[str, Any]


@dataclass(slots=True)
class RetireRun:
    """One retire or forget reaching every participant: a run ends when a server is called again."""

    called: set[str] = field(default_factory=set)
    highest: int = -1
    open: dict[str, tuple[str, int]] = field(default_factory=dict)  # call id -> (server, group)

    def sent(
        self, report: Report, seq: int, cid: str | None, server: str, kind: str | None, call_id: str
    ) -> None:
        """`retire_order` for one call of the run (module docstring)."""
        group = RETIRE_GROUP.get(kind or "")
        if server in self.called:  # the same server again: a new operation begins
            self.called.clear()
            self.highest = -1
            self.open.clear()
        self.called.add(server)
        if group is None:
            return
        if group < self.highest:
            report(seq, "retire_order", cid, server, f"{kind} called after a callee of a later stage")
        else:
            self.highest = group
        for other_id, (other, other_group) in self.open.items():
            if other_group < group:
                report(
                    seq,
                    "retire_order",
                    cid,
                    server,
                    f"sent while the call to {other} (call {other_id}), a caller of {kind}, had no outcome",
                )
                break
        self.open[call_id] = (server, group)

    def outcome(self, call_id: str) -> None:
        self.open.pop(call_id, None)


@dataclass(slots=True)
class V2Attempt:
    """What the v2 rules keep of one attempt (never its events)."""

    checkpoint_id: str
    kind: str
    epoch: int
    stop: bool
    participants: tuple[str, ...]
    kinds: dict[str, str]
    #: each participant's folder inside a snapshot (discovery's; absent: the snapshot itself)
    folders: dict[str, str] = field(default_factory=dict)
    source: str | None = None
    prepare_sent: set[str] = field(default_factory=set)
    prepared: set[str] = field(default_factory=set)
    restarts: dict[str, set[str]] = field(default_factory=dict)  # server -> reported restarts
    scope: frozenset[str] | None = None
    scope_source: str | None = None
    commit_shape: tuple[Any, Any, str] | None = None  # (checkpoint_dir, stop, first server)
    commit_scope: tuple[frozenset[str], str] | None = None  # first scope sent, and to whom
    unscoped: list[tuple[int, str]] = field(default_factory=list)  # commits sent with no scope
    committed: set[str] = field(default_factory=set)
    resumed: dict[str, int] = field(default_factory=dict)  # server -> seq of its first resume
    ended_seq: int | None = None
    published_seq: int | None = None
    outcomes: set[str] = field(default_factory=set)
    open: dict[str, _Sent] = field(default_factory=dict)
    run_max: dict[tuple[str, int, int], int] = field(default_factory=dict)
    retire_runs: dict[str, RetireRun] = field(default_factory=dict)
    restore_shape: tuple[Any, frozenset[str] | None, str] | None = None  # (dir, inventory, server)
    restored_ok: set[str] = field(default_factory=set)
    failed_seq: int | None = None  # the first sign a restore failed
    cleanup_retired: dict[str, tuple[int, frozenset[str] | None]] = field(default_factory=dict)
    cleanup_resumed: dict[str, int] = field(default_factory=dict)

    def stage(self, server: str) -> int | None:
        return STAGE.get(self.kinds.get(server, ""))

    # -- calls --------------------------------------------------------------------------------

    def sent(
        self,
        report: Report,
        seq: int,
        server: str,
        call_id: str,
        operation: str | None,
        phase: str,
        run: tuple[str, int, int],
        data: Mapping[str, Any],
    ) -> None:
        """The rules a `call.sent` of this attempt can break at once."""
        if operation is None:
            return
        body = _body(data)
        cid = self.checkpoint_id
        sent_id = body.get("checkpoint_id")
        if operation != "status" and operation != "restore" and sent_id not in (None, cid):
            report(
                seq, "same_id", cid, server, f"{operation} sent with checkpoint id {sent_id!r}, not {cid!r}"
            )
        rank: int | None = None
        stage = self.stage(server)
        if operation == "prepare":
            self._prepare(report, seq, server, stage)
        elif operation == "commit":
            self._commit(report, seq, server, body)
        elif operation == "renew":
            self._renew(report, seq, server)
        elif operation == "restore":
            self._restore(report, seq, server, body, sent_id)
        elif operation in ("retire", "forget"):
            run_ = self.retire_runs.setdefault(operation, RetireRun())
            run_.sent(report, seq, cid, server, self.kinds.get(server), call_id)
            if operation == "retire" and self.failed_seq is not None and server not in self.cleanup_retired:
                self.cleanup_retired[server] = (seq, _keys(body.get("episode_ids")))
        elif operation == "resume":
            self.resumed.setdefault(server, seq)
            if self.failed_seq is not None:
                self.cleanup_resumed.setdefault(server, seq)
            if self.stop and self.published_seq is not None:
                report(
                    seq,
                    "stop",
                    cid,
                    server,
                    f"resumed after the stop-checkpoint was published (seq {self.published_seq}): its"
                    " servers stay paused for shutdown",
                )
            if phase in RESUMING and stage is not None:
                rank = len(STAGE) - 1 - stage
                self._resume_order(report, seq, server, run, rank)
        self.open[call_id] = _Sent(server, operation, phase, run, rank, seq, body)

    def _prepare(self, report: Report, seq: int, server: str, stage: int | None) -> None:
        self.prepare_sent.add(server)
        if stage is None:
            return
        waiting = [p for p in self.participants if (self.stage(p) or 0) < stage and p not in self.prepared]
        if waiting:
            report(
                seq,
                "stage_order",
                self.checkpoint_id,
                server,
                f"prepare to {self.kinds.get(server)} {server} before {', '.join(waiting)} of an earlier"
                " stage answered prepared",
            )

    def _commit(self, report: Report, seq: int, server: str, body: Mapping[str, Any]) -> None:
        cid = self.checkpoint_id
        missing = [p for p in self.participants if p not in self.prepared]
        if missing:
            report(seq, "commit", cid, server, f"commit sent before {', '.join(missing)} answered prepared")
        shape = (self._base(server, body.get("checkpoint_dir")), body.get("stop"))
        if self.commit_shape is None:
            self.commit_shape = (*shape, server)
        elif shape != self.commit_shape[:2]:
            report(
                seq,
                "commit",
                cid,
                server,
                f"commit sent with checkpoint_dir/stop {shape!r}, but {self.commit_shape[2]} got"
                f" {self.commit_shape[:2]!r}",
            )
        if "stop" in body and body.get("stop") is not self.stop:
            report(
                seq,
                "commit",
                cid,
                server,
                f"commit sent with stop={body.get('stop')!r}; the attempt's is {self.stop}",
            )
        keys = _keys(body.get("episode_ids"))
        if keys is None:
            if self.kinds.get(server) != "environment" or self.scope is not None:
                report(
                    seq,
                    "commit",
                    cid,
                    server,
                    "commit sent with no scope: only an environment server, committed first to derive"
                    " the scope, may get none",
                )
            self.unscoped.append((seq, server))
            return
        if self.commit_scope is None:
            self.commit_scope = (keys, server)
        elif keys != self.commit_scope[0]:
            report(
                seq,
                "commit",
                cid,
                server,
                f"commit scope differs from the one sent to {self.commit_scope[1]}",
            )
        if self.scope is None:
            report(seq, "scope", cid, server, "commit sent with a scope before the scope was recorded")
            return
        outside = keys - self.scope
        if outside:
            report(
                seq,
                "scope",
                cid,
                server,
                f"commit names episodes outside the recorded scope: {_named(outside)}",
            )

    def _base(self, server: str, folder: Any) -> Any:
        """The folder a request names without the server's own `folder` at its end: what every
        server of one attempt must share. Anything else is left as sent, to be found different."""
        own = self.folders.get(server)
        if own and isinstance(folder, str) and folder.endswith(f"/{own}"):
            return folder[: -len(own) - 1]
        return folder

    def _renew(self, report: Report, seq: int, server: str) -> None:
        cid = self.checkpoint_id
        if server not in self.prepare_sent:
            report(seq, "renew", cid, server, "renew sent before the server's prepare")
        elif self.ended_seq is not None:
            report(seq, "renew", cid, server, f"renew sent after the attempt ended (seq {self.ended_seq})")
        elif server in self.resumed:
            report(seq, "renew", cid, server, f"renew sent after its resume (seq {self.resumed[server]})")

    def _restore(self, report: Report, seq: int, server: str, body: Mapping[str, Any], sent_id: Any) -> None:
        cid = self.checkpoint_id
        if sent_id not in (None, cid):
            report(
                seq,
                "restore",
                cid,
                server,
                f"restore sent with checkpoint id {sent_id!r}, not the restore's own",
            )
        shape = (self._base(server, body.get("checkpoint_dir")), _keys(body.get("episode_ids")))
        if self.restore_shape is None:
            self.restore_shape = (*shape, server)
        elif shape != self.restore_shape[:2]:
            report(
                seq,
                "restore",
                cid,
                server,
                f"restore sent with another folder or inventory than {self.restore_shape[2]}'s",
            )

    def _resume_order(
        self, report: Report, seq: int, server: str, run: tuple[str, int, int], rank: int
    ) -> None:
        cid = self.checkpoint_id
        highest = self.run_max.get(run)
        if highest is not None and rank < highest:
            report(
                seq,
                "stage_order",
                cid,
                server,
                f"{self.kinds.get(server)} resumed after a later stage's resume",
            )
        else:
            self.run_max[run] = rank
        for other_id, other in self.open.items():
            if other.run == run and other.rank is not None and other.rank < rank:
                report(
                    seq,
                    "stage_order",
                    cid,
                    server,
                    f"resume sent while the resume of {other.server} (call {other_id}, seq {other.seq}),"
                    " an earlier step, had no outcome",
                )
                break

    def outcome(self, report: Report, seq: int, call_id: str, acknowledged: bool, reply: Any) -> None:
        """What a call's outcome tells the rules (`call.replied` body, or none)."""
        call = self.open.pop(call_id, None)
        if call is None:
            return
        for run_ in self.retire_runs.values():
            run_.outcome(call_id)
        body = reply if isinstance(reply, Mapping) else {}
        phase = body.get("phase") if acknowledged else None
        if call.operation == "prepare" and acknowledged:
            if phase == "prepared":
                self.prepared.add(call.server)
            report_ = body.get("report")
            restarts = report_.get("restarts") if isinstance(report_, Mapping) else None
            if isinstance(restarts, list) and restarts:
                self.restarts.setdefault(call.server, set()).update(str(k) for k in restarts)
        elif call.operation == "commit" and phase == "committed":
            self.committed.add(call.server)
        elif call.operation == "restore":
            ok = phase == "restored" and body.get("source_checkpoint_id") == self.source
            if ok:
                self.restored_ok.add(call.server)
            elif self.failed_seq is None:
                self.failed_seq = seq

    # -- other events ---------------------------------------------------------------------------

    def event(self, report: Report, seq: int, kind: str, epoch: int, data: Mapping[str, Any]) -> None:
        """`episodes.*`, publication, failure and terminal events of this attempt."""
        cid = self.checkpoint_id
        if kind == "attempt.published" and self.published_seq is None:
            self.published_seq = seq  # the commit point: a stop-checkpoint resumes nobody after it
        if kind == "episodes.scoped":
            self._scoped(report, seq, data)
        elif kind == "episodes.exported":
            self._exported(report, seq, data)
        elif kind == "attempt.publishing" and epoch == self.epoch:
            for server in self.participants:
                if server not in self.committed:
                    report(seq, "publish", cid, server, "published before its commit replied committed")
        elif (
            kind in ("phase.failed", "attempt.aborting")
            and self.kind == "restore"
            and self.failed_seq is None
        ):
            if kind == "attempt.aborting" or data.get("phase") == "restore":
                self.failed_seq = seq
        elif kind in ("attempt.completed", "attempt.aborted"):
            if self.ended_seq is None:
                self.ended_seq = seq
            outcome = data.get("outcome") if kind == "attempt.completed" else "aborted"
            self.outcomes.add(str(outcome))
            if kind == "attempt.completed" and self.stop and outcome == "published" and data.get("servers"):
                report(
                    seq,
                    "stop",
                    cid,
                    None,
                    f"a stop-checkpoint ends with no server resumed, not {data.get('servers')!r}",
                )

    def _exported(self, report: Report, seq: int, data: Mapping[str, Any]) -> None:
        exported = data.get("exported")
        if not isinstance(exported, Mapping) or self.scope is None:
            return
        restarts: set[str] = set().union(*self.restarts.values()) if self.restarts else set()
        for server, keys in exported.items():
            allowed = set(self.scope)
            if self.scope_source == "derived" and self.kinds.get(str(server)) == "environment":
                allowed |= restarts
            outside = {str(k) for k in keys or ()} - allowed
            if outside:
                report(
                    seq,
                    "scope",
                    self.checkpoint_id,
                    str(server),
                    f"exported episodes outside the scope: {_named(outside)}",
                )

    def _scoped(self, report: Report, seq: int, data: Mapping[str, Any]) -> None:
        cid = self.checkpoint_id
        scope = _keys(data.get("scope")) or frozenset()
        self.scope = scope
        self.scope_source = str(data.get("source"))
        recorded = data.get("restarts")
        if isinstance(recorded, Mapping):
            for server, keys in recorded.items():
                self.restarts.setdefault(str(server), set()).update(str(k) for k in keys or ())
        for server, keys in self.restarts.items():
            inside = keys & scope
            if inside:
                report(
                    seq, "scope", cid, server, f"the scope names restarts {server} reported: {_named(inside)}"
                )
        if self.scope_source != "derived":
            for sent_seq, server in self.unscoped:
                report(
                    seq,
                    "commit",
                    cid,
                    server,
                    f"committed with no scope (seq {sent_seq}), but the scope is {self.scope_source},"
                    " not derived",
                )

    # -- at the end -----------------------------------------------------------------------------

    def judge(self, report: Report, terminal_seq: int) -> None:
        """The rules judged once the attempt has ended: a restore's completeness, all or nothing."""
        if self.kind != "restore":
            return
        cid = self.checkpoint_id
        finished = bool(self.outcomes & {"restored", "resumed"})
        if finished and self.failed_seq is None:
            for server in self.participants:
                if server not in self.restored_ok:
                    report(
                        terminal_seq,
                        "restore",
                        cid,
                        server,
                        f"the restore finished without {server} restored from {self.source}",
                    )
        if self.failed_seq is None:
            return
        if "aborted" not in self.outcomes or finished:
            report(terminal_seq, "all_or_nothing", cid, None, "a failed restore must end attempt.aborted")
        inventory = self.restore_shape[1] if self.restore_shape is not None else None
        expected = frozenset(next_attempt_key(k) for k in inventory or ())
        for server in self.participants:
            retired = self.cleanup_retired.get(server)
            if expected:
                if retired is None:
                    report(
                        terminal_seq,
                        "all_or_nothing",
                        cid,
                        server,
                        f"the failed restore (seq {self.failed_seq}) never retired its next attempts"
                        f" on {server}",
                    )
                elif retired[1] != expected:
                    report(
                        retired[0],
                        "all_or_nothing",
                        cid,
                        server,
                        "the cleanup retire does not name exactly the next attempts of the inventory",
                    )
            resumed = self.cleanup_resumed.get(server)
            if resumed is None:
                report(
                    terminal_seq,
                    "all_or_nothing",
                    cid,
                    server,
                    f"the failed restore (seq {self.failed_seq}) never resumed {server}",
                )
            elif retired is not None and resumed < retired[0]:
                report(resumed, "all_or_nothing", cid, server, "resumed before its cleanup retire")


@dataclass(slots=True)
class Operations:
    """Retires and forgets sent outside any attempt (`call.sent` with no checkpoint id): their
    `retire_order`, per operation (the id their requests carry)."""

    runs: dict[tuple[str, str], RetireRun] = field(default_factory=dict)
    open: dict[str, tuple[str, str]] = field(default_factory=dict)  # call id -> run key

    def sent(
        self,
        report: Report,
        seq: int,
        server: str,
        call_id: str,
        operation: str,
        kind: str | None,
        data: Mapping[str, Any],
    ) -> None:
        key = (str(_body(data).get("checkpoint_id")), operation)
        self.runs.setdefault(key, RetireRun()).sent(report, seq, None, server, kind, call_id)
        self.open[call_id] = key

    def outcome(self, call_id: str) -> None:
        key = self.open.pop(call_id, None)
        if key is not None:
            self.runs[key].outcome(call_id)
