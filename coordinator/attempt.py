"""One checkpoint attempt (save) or restore: its state, its deadline, and the rules every step of it keeps.

The steps live beside this file, one concern each: `save.py` (start, prepare, commit, publish),
`resume.py` (resume and rollback), `restore.py`, `readback.py` (an attempt rebuilt from the ledger);
`recovery.py` drives them after a coordinator died.

Ledger sequence of a save attempt (every call is `call.sent` → `call.replied | call.failed`, see calls.py):

    attempt.started {kind: save, deadline_ts, participants, staging_dir}
    phase.started prepare  … calls …  phase.completed prepare
    phase.started commit   … calls …  phase.completed commit
    phase.started publish  attempt.publishing (manifest written)  attempt.published (renamed)  phase.completed
    phase.started resume   … calls …  phase.completed resume   attempt.completed {outcome: published}

On a failure before publication: `phase.failed`, `attempt.aborting`, resume calls (call.sent with
phase "rollback") to every *touched* server (a request was sent, answered or not) in resume order,
then `attempt.aborted {resumed, left_paused, not_paused}`; the staging folder is removed and a
`PhaseError` (or `DeadlineExceeded`) is raised naming the phase, the server, the reason, who was
resumed, who could not be, and the latest snapshot still in place.

A restore: `attempt.started {kind: restore, snapshot_dir, source_checkpoint_id, resume}`, phase
restore (policy → agents → resources), then either `attempt.completed {outcome: restored}` — the
servers stay paused for the caller, whose later `resume` appends phase resume and
`attempt.completed {outcome: resumed}` — or, when the caller asked for the resume at once
(`resume: true`), phase resume straight away and one terminal record, `attempt.completed {outcome:
resumed}`: a restore is not terminal until its resume finished or it was explicitly left for the
caller. A failed restore is not rolled back (half-restored state must not run): `attempt.aborted`
lists every server it may have restored as `left_paused`; an explicit `resume` resumes them.

On Gym's unified plane (v2; `attempt.started {plane: v2}`) the same engine runs the plane's own
driver (`save_v2.py`, `restore_v2.py`): prepare stage by stage (`episodes.blocked` when not
ready), `episodes.scoped` before the commit is sent and `episodes.exported` after its replies, the
caller's block and publication under lease renewals (`renewal.py`, calls of phase `renew`); a
stop-checkpoint ends `attempt.completed {published}` with no resume. A restore fans out at once
and records `episodes.restored`; a failed one retires the next attempts everywhere and resumes
everyone before `attempt.aborted` (nothing half-restored is kept paused on this plane).

A request the server refused before it ran it (`protocol.refused_before_effect`: a wrong token,
another checkpoint id active) paused nothing: the server is in `Attempt.refused`, and neither a
rollback nor recovery resumes it (`Attempt.may_hold`).

Checkpoint ids: `next_checkpoint_id`, by the rule in `ids.py` (unique across ledgers).

Deadline: one absolute `deadline_ts` per attempt. Every call's timeout is the time left to it, and
each phase runs inside an anyio cancel scope whose deadline is `deadline_ts` converted to anyio's
clock. Rollback and the resume after publication use `max(deadline_ts, now + control_timeout_s)`.

Durability: every event is committed before any action that follows it leaves the process, but
only those an outside action waits on are forced to disk: `attempt.started` (it lists every
participant — every server the attempt may touch — before the first request leaves),
`phase.failed`, and the terminal events of a failure (`attempt.aborted`) or of a restore
(`attempt.completed {restored}`). Every POST's `call.sent` and a resume's `attempt.completed` are
write-behind (`durable=False`): committed when appended, on disk with the next durable append,
the ledger's close, or the kernel's writeback. Outcomes, phase boundaries, `attempt.aborting`,
`attempt.publishing` and `attempt.published` are staged (`Ledger.stage`): chained at once and
committed in the transaction of the next append — a `call.sent`, a durable record, or the
operation's last event. `attempt.started` is staged too, with `durable=True`: the transaction
of the attempt's first `call.sent` (or, if no request is sent, of its next record) carries it and
is fsynced, so it is on disk before the first request leaves without a transaction of its own.
A read's `call.sent` is staged (calls.py). A save of k POST requests thus costs k + 1
transactions (one fsynced), whatever its number of events.
A crash loses only staged events, and a staged event lost leaves the ledger as a crash just
before it would have — with one exception that recovery covers: the snapshot's rename does not
wait for the publish step's records. The fsynced rename is the commit point, and recovery reads
publication from the filesystem for every unfinished save (the final folder follows from the
staging folder that the durable `attempt.started` records: `final_dir_of`), whatever the ledger
kept of the publish step, then resumes again (the servers replay their recorded resume). After a
power failure the ledger is a prefix of what was committed, so a lost `call.sent` can only hide a
touched server among the participants of a durable `attempt.started`; recovery asks those
servers whether they saw the checkpoint id (`recovery.py`).

Everything a later coordinator needs is in the ledger: `readback.load_attempt` rebuilds an
`Attempt` (participants, touched servers, publication) from events alone; `FencedError` is never
caught by any step.
"""

from __future__ import annotations

import contextlib
import shlex
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
import anyio.to_thread
from pydantic import BaseModel

from quiesce.coordinator import ids, protocol_v2
from quiesce.coordinator.calls import Body, Caller, CallResult
from quiesce.coordinator.config import ClusterConfig
from quiesce.coordinator.digests import DigestCache
from quiesce.coordinator.discovery import Member
from quiesce.coordinator.errors import QuiesceError
from quiesce.coordinator.phases import Plane, Role, resume_order
from quiesce.coordinator.protocol import (
    CommonBody,
    refused_before_effect,
    route,
)
from quiesce.coordinator.publish import in_place_roots
from quiesce.ledger import Ledger

T = TypeVar("T")


AttemptKind = Literal["save", "restore"]
AttemptState = Literal[
    "started", "prepared", "committed", "publishing", "published", "completed", "restored", "aborted"
]


ProgressStep = Literal["phase", "call", "reply", "done", "failed"]


@dataclass(frozen=True)
class Progress:
    """A progress report for a caller's display, sent as things happen (`step`):

    - `phase`: a phase starts; `servers` is how many servers it addresses (None: not servers'
      work, e.g. publish), `deadline_ts` the deadline its calls run under;
    - `call`: a control call to `server` is about to leave (`inflight`, `state`: the policy
      model's status while it drains);
    - `reply`: `server`'s call ended — answered (`error` None) or failed (`error` says how);
    - `done` / `failed`: the phase ended; `failed` carries the reason in `error` and the server
      at fault, if any, in `server` (sent when `phase.failed` is recorded).

    Display only: a failing callback never disturbs the attempt (`Context.progress`).
    """

    checkpoint_id: str
    phase: str
    server: str | None = None
    inflight: int | None = None
    state: str | None = None
    step: ProgressStep = "call"
    error: str | None = None
    servers: int | None = None
    deadline_ts: float | None = None


ProgressCallback = Callable[[Progress], None]


@dataclass(frozen=True)
class Resubmission:
    """One execution a restore continues but does not run: the caller must send agent `server`'s
    `/run` for `rollout_id` as `attempt_index` (the saved attempt + 1) once the servers resume.

    Gym's agent restore retires each saved execution (rollout, n) — a `/run` of it answers 409
    `stale_attempt` — and keeps its saved boundary as the continuation of (rollout, n+1), which
    runs only when that `/run` arrives; a resume releases nothing of it. Nothing else tells the
    trainer which executions to send again, so a restore lists them (`Attempt.resubmit`).
    """

    server: str
    rollout_id: str
    attempt_index: int

    def as_json(self) -> dict[str, Any]:
        return {"server": self.server, "rollout_id": self.rollout_id, "attempt_index": self.attempt_index}


@dataclass(frozen=True)
class UnknownResubmissions:
    """An agent whose saved folder does not say which executions a restore continues (another
    layout, a record that is not a boundary record, an identity not its file name): its state was
    restored all the same — the snapshot's digests were verified — but the caller must find out
    from the agent (or its own records) what to send `/run` for again. `reason` says why."""

    server: str
    reason: str

    def as_json(self) -> dict[str, Any]:
        return {"server": self.server, "reason": self.reason}


@dataclass(frozen=True)
class Outcome:
    """What a resume, abort or restore did: the servers in call order and where each one ended."""

    checkpoint_id: str | None
    outcome: str
    servers: tuple[str, ...] = ()
    resumed: tuple[str, ...] = ()
    not_paused: tuple[str, ...] = ()
    left_paused: tuple[str, ...] = ()
    #: when several checkpoint ids held the servers: what was done for the others, in order
    also: tuple[Outcome, ...] = ()
    #: the resume of a restore: what the caller must send `/run` for again (`Attempt.resubmit`)
    resubmit: tuple[Resubmission, ...] = ()
    #: the resume of a restore: servers that had restarted since it and were restored again first
    restored_again: tuple[str, ...] = ()
    #: the control plane of its servers (`v2`: `resubmit` lists replacement attempts to start)
    plane: str = "v1"
    #: the resume of a restore: executions whose saved continuation was discarded (`Attempt.restart`)
    restart: tuple[Resubmission, ...] = ()
    #: the resume of a restore: agents whose resubmissions are unknown (`Attempt.resubmit_unknown`)
    resubmit_unknown: tuple[UnknownResubmissions, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The `--json` document of `quiesce restore | resume | abort` (`also`, `resubmit` and
        `restored_again` only when not empty)."""
        out: dict[str, Any] = {
            "checkpoint_id": self.checkpoint_id,
            "outcome": self.outcome,
            "servers": list(self.servers),
        }
        if self.also:
            out["also"] = [o.as_json() for o in self.also]
        if self.resubmit:
            out["resubmit"] = [r.as_json() for r in self.resubmit]
        if self.restored_again:
            out["restored_again"] = list(self.restored_again)
        if self.restart:
            out["restart"] = [r.as_json() for r in self.restart]
        if self.resubmit_unknown:
            out["resubmit_unknown"] = [u.as_json() for u in self.resubmit_unknown]
        if self.plane != "v1":
            out["plane"] = self.plane
        return out


@dataclass
class Context:
    """What an attempt needs from its coordinator."""

    config: ClusterConfig
    ledger: Ledger
    caller: Caller
    on_progress: ProgressCallback | None = None
    #: the file the config was read from, named in the commands a message tells the user to run
    config_path: str | None = None
    #: the address of the `quiesce serve` this coordinator runs in (its `advertise`): it holds the
    #: ledger while it runs, so the commands a message names go through it (`--service`)
    service: str | None = None

    def progress(self, report: Progress) -> None:
        """Report progress; a failing callback never disturbs the attempt."""
        if self.on_progress is not None:
            with contextlib.suppress(Exception):
                self.on_progress(report)


@dataclass
class Attempt:
    """One save or restore attempt.

    `staging_dir` is where servers write and where the caller adds its own half (save only);
    `snapshot` is the published folder (save: set after publish; restore: the source snapshot).
    `touched` lists, in first-contact order, every server a control request was sent to;
    `refused` names those of them whose every request (a resume aside) the server refused before
    it ran (`protocol.refused_before_effect`: a wrong token, another checkpoint id active, ...),
    with the refusal: this attempt paused nothing there, so nothing is resumed there either.
    """

    checkpoint_id: str
    kind: AttemptKind
    deadline_ts: float
    participants: tuple[Member, ...]
    staging_dir: Path | None = None
    #: save: committed into a folder its caller owns (`Coordinator.save(into=...)`) and published
    #: there in place: only the servers' folders in it (`staging_roots`) are the attempt's
    in_place: bool = False
    #: save: (device, inode) of the staging folder this attempt made (`publish.make_staging`);
    #: publication takes that very folder only (`publish.staging_problem`)
    staging_identity: tuple[int, int] | None = None
    #: save: why the staging folder could not be made (`staging.made_for_commit` fails the commit)
    staging_problem: str | None = None
    snapshot: Path | None = None
    source_checkpoint_id: str | None = None
    #: restore: the sha256 of the snapshot's manifest when the restore began (recorded in
    #: `attempt.started`); a re-driven restore refuses a snapshot whose manifest has changed since
    snapshot_sha256: str | None = None
    state: AttemptState = "started"
    touched: list[str] = field(default_factory=list)
    commits: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: list[dict[str, str]] = field(default_factory=list)
    inflight: int | None = None
    last_server: str | None = None
    #: warnings given before the first request (recorded in `attempt.started`): preflight, provenance
    warnings: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    #: servers whose last state-changing request (a resume aside) got no reply — a timeout, a
    #: broken connection, a call the deadline cancelled on its way: its operation may still be
    #: running there, so a rollback reads their fence before it resumes them
    #: (`resume.resume_members`, `check_first`)
    unanswered: set[str] = field(default_factory=set)
    #: the last refusal that explains why a server is not ready yet, while the phase keeps asking
    #: it again (an agent's 409 `agent_prepare_incomplete`, with the unacknowledged executions it
    #: was found to hold): server → that failure, dropped once the server's request succeeds or
    #: fails otherwise. When the deadline ends the phase meanwhile, this is what `run_phase`
    #: reports — not a bare "deadline passed" — whichever request was in flight at that moment.
    waiting_on: dict[str, PhaseFailure] = field(default_factory=dict)
    #: failures of a parallel role group's members that have already ended while their siblings
    #: still run (`each_member`): server → failure. Should the deadline end the group's wait, this
    #: is what `run_phase` reports, so a failure already known is never lost to a bare "deadline
    #: passed". Cleared when a phase starts.
    settled: dict[str, PhaseFailure] = field(default_factory=dict)
    #: what its resume did, once a resume of it finished in this process (`restore(resume=True)`)
    resume_outcome: Outcome | None = None
    #: restore, once its restore phase succeeded: every execution the caller must send `/run` for
    #: again (`Resubmission`), read from the snapshot's agent folders — for each agent participant
    #: in participant order, each saved record's (rollout_id, attempt_index + 1), sorted by rollout
    #: id then attempt. Empty before then, for a save, and when no agent saved a rollout.
    resubmit: tuple[Resubmission, ...] = ()
    #: restore: agents whose folder does not say which executions to send again (left out of
    #: `resubmit`, each with the reason); their state was restored all the same
    resubmit_unknown: tuple[UnknownResubmissions, ...] = ()
    #: restore, once its restore phase succeeded: executions (rollout, n+1) whose restored
    #: continuation a later agent discarded because it depends on a `restart_only` resources
    #: server (`restore.discards`) — the caller sends their `/run`, which starts from the task
    #: (not in `resubmit`)
    restart: tuple[Resubmission, ...] = ()
    #: restore: the `restart_only` resources servers of the cluster when it began (recorded in
    #: `attempt.started`): a re-driven restore discards against the same set
    restart_only: tuple[str, ...] = ()
    #: restore: the agents that can discard a restored continuation (`restore.can_discard`),
    #: recorded in `attempt.started` beside `restart_only`
    discarding: tuple[str, ...] = ()
    #: servers whose resume under this id answered `accepting` (in this process, or recorded:
    #: `readback`): they run, and nothing is sent to them again but a resume (which replays)
    resumed: set[str] = field(default_factory=set)
    #: restore: participants found restarted since its restore phase (their fence held nothing of
    #: it) and restored again under the same id before any server was resumed (`restore.reinstate`)
    restored_again: tuple[str, ...] = ()
    #: unified plane (v2): the episodes the commit covered (capture keys, sorted) — given by the
    #: caller or derived — and the restarts each server reported (left out of it)
    scope: tuple[str, ...] = ()
    restarts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: v2 save: the servers not ready by the prepare's deadline → the blockers each reported (at
    #: most `protocol_v2.MAX_BLOCKERS`), as `episodes.blocked` records them
    blocked: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: v2: what each server's commit exported (capture keys)
    exported: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: v2 restore: the next attempts each server restored (capture keys)
    restored: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: v2 save: committed with `stop` — published, the servers stay paused for shutdown
    stop: bool = False
    #: v2: why a lease renewal found a server no longer holding this attempt (None while it holds)
    lease_lost: str | None = None
    #: facts of the staging files read so far: publish does not read again what commit verified
    digests: DigestCache = field(default_factory=DigestCache, repr=False, compare=False)
    _touched: set[str] = field(default_factory=set, init=False, repr=False, compare=False)
    _reached: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._touched.update(self.touched)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.participants]

    @property
    def plane(self) -> Plane:
        """The control plane of its participants (one per cluster)."""
        return "v2" if any(m.plane == "v2" for m in self.participants) else "v1"

    @property
    def staging_roots(self) -> list[str] | None:
        """In place: the folders of `staging_dir` that are the attempt's (its servers'); None when
        the whole staging folder is (a save into quiesce's own snapshots folder)."""
        return in_place_roots(m.folder for m in self.participants) if self.in_place else None

    def resubmit_on(self, server: str) -> tuple[Resubmission, ...]:
        """The executions of `resubmit` to send to agent `server`."""
        return tuple(r for r in self.resubmit if r.server == server)

    def group(self, role: Role) -> tuple[Member, ...]:
        return tuple(m for m in self.participants if m.role == role)

    def member(self, name: str) -> Member | None:
        return next((m for m in self.participants if m.name == name), None)

    def touch(self, name: str) -> None:
        if name not in self._touched:
            self._touched.add(name)
            self.touched.append(name)

    def note_outcome(self, name: str, status: int | None, code: str | None) -> None:
        """Record the outcome of a request (not a resume) sent to `name`: a refusal before it ran
        keeps the server in `refused` until any other outcome (a lost reply included) reaches it."""
        if name in self._reached:
            return
        if refused_before_effect(status, code):
            self.refused.setdefault(name, f"http {status}" + (f" {code}" if code else ""))
        else:
            self._reached.add(name)
            self.refused.pop(name, None)

    @property
    def may_hold(self) -> list[str]:
        """The touched servers this attempt may have paused (first-contact order)."""
        return [name for name in self.touched if name not in self.refused]


class PhaseFailure(Exception):
    """A phase failed at `server` (None: not one server's fault); the caller rolls back or abandons."""

    def __init__(
        self, phase: str, server: str | None, reason: str, code: str | None = None, *, deadline: bool = False
    ) -> None:
        super().__init__(reason)
        self.phase = phase
        self.server = server
        self.reason = reason
        self.code = code
        self.deadline = deadline

    def with_others(self, others: Sequence[PhaseFailure]) -> PhaseFailure:
        """This failure (its server and code stay the ones reported), its reason naming the other
        servers that failed the same step too — so a user fixes them all at once, not one per try."""
        if not others:
            return self
        also = "; ".join(f"{o.server or 'the coordinator'}: {o.reason}" for o in others)
        return PhaseFailure(
            self.phase, self.server, f"{self.reason} (also: {also})", self.code, deadline=self.deadline
        )


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def anyio_deadline(deadline_ts: float) -> float:
    """A wall-clock deadline (Unix seconds) on anyio's clock."""
    return anyio.current_time() + (deadline_ts - time.time())


def common_body(attempt: Attempt, deadline_ts: float | None = None) -> CommonBody:
    return CommonBody(checkpoint_id=attempt.checkpoint_id, deadline_ts=deadline_ts or attempt.deadline_ts)


def plain_body(member: Member, checkpoint_id: str, deadline_ts: float) -> BaseModel:
    """The body of a resume (or prepare) on `member`'s plane: v1's `CommonBody` (with
    `schema_version`), or the unified plane's `CheckpointRequest` (which refuses that field)."""
    if member.plane == "v2":
        return protocol_v2.CheckpointRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
    return CommonBody(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)


async def send_call(
    ctx: Context,
    attempt: Attempt,
    member: Member,
    operation: str,
    phase: str,
    *,
    body: BaseModel | Body | None = None,
    params: dict[str, Any] | None = None,
    deadline_ts: float | None = None,
    expect_checkpoint: str | None = None,
) -> CallResult:
    """Send one control call for `attempt` (marks the server touched first). With
    `expect_checkpoint`, a reply naming another checkpoint id is a failed call (`calls.py`).
    The route is the member's plane's: v1's per-component route, or the unified plane's.
    `body`: a request model, or one encoded once for many servers (`calls.encode_body`)."""
    spec: Any = protocol_v2.ROUTES[operation] if member.plane == "v2" else route(member.component, operation)
    settles = spec.method == "POST" and operation != "resume"
    if spec.method == "POST":
        attempt.touch(member.name)
    if settles:  # unanswered until a reply arrives: a call cancelled on the way stays so
        attempt.unanswered.add(member.name)
    attempt.last_server = member.name
    result = await ctx.caller.call(
        member.target,
        spec,
        phase=phase,
        checkpoint_id=attempt.checkpoint_id,
        deadline_ts=deadline_ts or attempt.deadline_ts,
        body=body,
        params=params,
        expect_checkpoint=expect_checkpoint,
    )
    if settles:
        attempt.note_outcome(member.name, result.status if result.error == "http" else None, result.code)
        if result.status is not None or not result.sent:
            attempt.unanswered.discard(member.name)
    if ctx.on_progress is not None:
        error = None if result.ok else result.describe()
        ctx.progress(Progress(attempt.checkpoint_id, phase, member.name, step="reply", error=error))
    return result


def expect_reply(result: CallResult, model: type[T], phase: str, what: str) -> T:
    """The validated reply, or `PhaseFailure` describing the call's failure."""
    if result.ok and isinstance(result.reply, model):
        return result.reply
    raise PhaseFailure(
        phase,
        result.server,
        f"{what} failed: {result.describe()}",
        result.code,
        deadline=result.error == "timeout",
    )


async def each_member(
    ctx: Context, attempt: Attempt, members: Sequence[Member], fn: Callable[[Member], Awaitable[T]]
) -> dict[str, T]:
    """Run `fn` over one role group of `attempt`: one at a time, or concurrently with
    `fanout: parallel`.

    Sequential: stops at the first failure. Parallel: every call runs to its own end, then the
    first failure (in config order) is raised, its reason naming every other failed server —
    siblings are never cancelled mid-call. Each failure is kept in `Attempt.settled` as soon as
    its member ends, so a deadline that cancels the wait for the others still reports it.
    """
    results: dict[str, T] = {}
    if ctx.config.fanout == "sequential" or len(members) <= 1:
        for member in members:
            results[member.name] = await fn(member)
        return results

    async def one(member: Member) -> None:
        try:
            results[member.name] = await fn(member)
        except PhaseFailure as failure:
            attempt.settled[member.name] = failure

    async with anyio.create_task_group() as tg:
        for member in members:
            tg.start_soon(one, member)
    failed = [attempt.settled[m.name] for m in members if m.name in attempt.settled]
    if failed:
        raise failed[0].with_others(failed[1:])
    return results


async def record_phase_failed(
    ctx: Context, checkpoint_id: str, phase: str, server: str | None, reason: str, code: str | None
) -> None:
    """Append `phase.failed` — durable before the caller rolls back, abandons or raises."""
    await ctx.ledger.append(
        "phase.failed",
        checkpoint_id=checkpoint_id,
        server=server,
        data={"phase": phase, "server": server, "reason": reason, "code": code},
    )
    ctx.progress(Progress(checkpoint_id, phase, server, step="failed", error=reason))


def recovery_budget(ctx: Context, attempt: Attempt) -> float:
    """The budget of the calls that let servers go (rollback, resume, the fence reads before them):
    `max(deadline_ts, now + control_timeout_s)`."""
    return max(attempt.deadline_ts, time.time() + ctx.config.control_timeout_s)


async def run_phase(
    ctx: Context,
    attempt: Attempt,
    phase: str,
    body: Callable[[], Awaitable[dict[str, Any]]],
    *,
    own_budget: bool = False,
    staging_dir: Path | None = None,
) -> dict[str, Any]:
    """Run one phase inside the attempt's deadline scope, with phase.started / phase.completed.
    `own_budget`: `attempt.deadline_ts` was set anew for this run (not the one `attempt.started`
    recorded), and `phase.started` records it. `staging_dir`: the folder a save started in place
    commits into, named only now — `phase.started` records it, durably, before `body` runs.

    Raises `PhaseFailure` (deadline=True when the scope expired) — the caller rolls back. When
    the deadline ends it while participants were being asked again (`Attempt.waiting_on`) or
    after some had already failed (`Attempt.settled`), the failure is the first one's (in config
    order) — its code, and what it named — marked as a deadline, naming the others' too.
    """
    started: dict[str, Any] = {"phase": phase}
    if own_budget:
        started["deadline_ts"] = attempt.deadline_ts
    if staging_dir is not None:
        started["staging_dir"] = str(staging_dir)
    if staging_dir is not None:  # on disk before anything is created there (recovery removes it)
        await ctx.ledger.append("phase.started", checkpoint_id=attempt.checkpoint_id, data=started)
    else:
        await ctx.ledger.stage("phase.started", checkpoint_id=attempt.checkpoint_id, data=started)
    servers = len(attempt.participants)
    ctx.progress(
        Progress(attempt.checkpoint_id, phase, step="phase", servers=servers, deadline_ts=attempt.deadline_ts)
    )
    attempt.last_server = None
    attempt.settled.clear()
    summary: dict[str, Any] | None = None
    with anyio.CancelScope(deadline=anyio_deadline(attempt.deadline_ts)) as scope:
        summary = await body()
    if scope.cancelled_caught or summary is None:
        known = {n: f for n, f in attempt.waiting_on.items() if f.phase == phase}
        known.update((n, f) for n, f in attempt.settled.items() if f.phase == phase)
        reported = [known[n] for n in attempt.names if n in known]
        if reported:  # servers still being asked again, or already failed, when the deadline hit
            first = reported[0]
            raise PhaseFailure(phase, first.server, first.reason, first.code, deadline=True).with_others(
                reported[1:]
            )
        reason = "the attempt's deadline passed"
        if phase == "prepare" and attempt.inflight:
            reason += f" while draining: {attempt.inflight} requests still in flight"
        # the call in flight when the deadline hit is the one that did not finish in time
        raise PhaseFailure(phase, attempt.last_server, reason, deadline=True)
    await ctx.ledger.stage(
        "phase.completed", checkpoint_id=attempt.checkpoint_id, data={"phase": phase, "summary": summary}
    )
    ctx.progress(Progress(attempt.checkpoint_id, phase, step="done"))
    return summary


#: ledger → its ledger id (`quiesce.coordinator.ids`), read once per open ledger
_LEDGER_IDS: weakref.WeakKeyDictionary[Ledger, str | None] = weakref.WeakKeyDictionary()


async def ledger_id(ledger: Ledger) -> str | None:
    """The id of `ledger`: from the hash of its first event, read once (it never changes)."""
    if ledger in _LEDGER_IDS:
        return _LEDGER_IDS[ledger]
    found: str | None = None
    events = ledger.read(page_size=1)
    try:
        async for event in events:
            found = ids.ledger_id_of(event.hash)
            break
    finally:
        close = getattr(events, "aclose", None)  # an async generator: its query ends now
        if close is not None:
            await close()
    _LEDGER_IDS[ledger] = found
    return found


async def next_checkpoint_id(ledger: Ledger) -> str:
    """The id of a new attempt: `q<ledger id>-<seq>-e<epoch>-w<writer>` (`quiesce.coordinator.ids`),
    unique across ledgers and across copies of one, with the seq its `attempt.started` will get
    (single writer)."""
    return ids.checkpoint_id(
        await ledger_id(ledger), ledger.epoch, await ledger.last_seq() + 1, ledger.epoch_hash
    )


def command_line(config_path: str | None, verb: str, *args: str, service: str | None = None) -> str:
    """The command line that runs `verb` (resume, abort, acknowledge, ...) with `args`, for the
    cluster of `config_path` (`CONFIG` when the config did not come from a file).

    With `service` — the address of the `quiesce serve` that holds the ledger, `URL` when it is not
    known — it goes through that service (`--service URL`) instead: while a service runs, a command
    that opens the ledger itself fails ("already has a writer")."""
    where = (
        f"--service {shlex.quote(service)}"
        if service
        else f"--config {shlex.quote(config_path) if config_path else 'CONFIG'}"
    )
    return " ".join(["quiesce", verb, where, *(shlex.quote(a) for a in args)])


def free_command(ctx: Context, verb: str, checkpoint_id: str) -> str:
    """`command_line` for this coordinator's config, through its service when it serves."""
    return command_line(ctx.config_path, verb, checkpoint_id, service=ctx.service)


def recover_hint(ctx: Context, checkpoint_id: str) -> str:
    """The command that finishes what an attempt left, quoted: `quiesce recover` — or, when this
    coordinator serves (a `quiesce recover` would find the ledger taken), the resume of
    `checkpoint_id` through the service, which finishes it the same way."""
    if ctx.service:
        return f"`{free_command(ctx, 'resume', checkpoint_id)}`"
    return "`quiesce recover`"


def require_state(attempt: Attempt, states: tuple[str, ...], step: str) -> None:
    if attempt.state not in states:
        raise QuiesceError(
            f"cannot {step} checkpoint {attempt.checkpoint_id}: it is {attempt.state}"
            f" (expected {' or '.join(states)})"
        )


def resume_sorted(attempt: Attempt, names: Sequence[str]) -> list[str]:
    order = {role: i for i, role in enumerate(resume_order(attempt.plane))}
    return sorted(names, key=lambda n: order.get(m.role, 99) if (m := attempt.member(n)) else 99)
