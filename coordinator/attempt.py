"""One checkpoint attempt (save) or restore: phases, the deadline, rollback — all recorded in the ledger.

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

A restore: `attempt.started {kind: restore, snapshot_dir, source_checkpoint_id}`, phase restore
(policy → agents → resources), `attempt.completed {outcome: restored}`; the servers stay paused until
`resume`, which appends phase resume and `attempt.completed {outcome: resumed}`. A failed restore
is not rolled back (half-restored state must not run): `attempt.aborted` lists every touched server
as `left_paused`; an explicit `resume` resumes them.

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

Everything a later coordinator needs is in the ledger: `load_attempt` rebuilds an `Attempt`
(participants, touched servers, publication) from events alone; `FencedError` is never caught here.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import anyio
import anyio.to_thread
from pydantic import BaseModel, ValidationError

from coordinator.calls import Caller, CallResult
from coordinator.config import ClusterConfig
from coordinator.digests import DigestCache, file_digest, regular_facts
from coordinator.discovery import Discovery, Member
from coordinator.errors import DeadlineExceeded, FencedError, PhaseError, QuiesceError, SnapshotError
from coordinator.phases import Role, resume_order
from coordinator.protocol import (
    AGENT,
    INVALID_PHASE,
    MODEL,
    RESOURCES,
    AgentCommitReply,
    AgentPrepareReply,
    AgentRestoreReply,
    ArtifactRef,
    CheckpointDirBody,
    CommonBody,
    ModelCommitBody,
    ModelCommitReply,
    ModelPauseReply,
    ModelRestoreReply,
    ModelStatusReply,
    ResourcesCommitReply,
    ResourcesPrepareReply,
    ResourcesRestoreReply,
    StatusQuery,
    Workers,
    manifest_path,
    route,
)
from coordinator.protocol import (
    AGENT_PREPARE_INCOMPLETE as _AGENT_PREPARE_INCOMPLETE,
)
from coordinator.publish import (
    MANIFEST,
    Snapshot,
    apply_retention,
    build_manifest,
    load_snapshot,
    make_staging,
    read_latest,
    remove_tree,
    rename_into_place,
    sweep_staging,
    tree_digests,
    verify_artifact,
    write_json_durably,
    write_latest,
)
from ledger import Event, Ledger, utc_now

__all__ = [
    "Attempt",
    "Context",
    "Outcome",
    "Progress",
    "ProgressCallback",
    "commit",
    "find_paused",
    "finish_resume",
    "load_attempt",
    "prepare",
    "publish",
    "restore",
    "resume_sorted",
    "roll_back",
    "start_attempt",
]

T = TypeVar("T")

#: Longest single status long-poll while draining (so progress is reported at least this often).
DRAIN_POLL_S: Final = 1.0
#: The long-poll's own timeout stays this far below the time left, so its reply beats the deadline.
POLL_MARGIN_S: Final = 0.2
#: How often `agent_prepare_incomplete` is retried (at most).
AGENT_RETRY_S: Final = 0.1

AttemptKind = Literal["save", "restore"]
AttemptState = Literal[
    "started", "prepared", "committed", "publishing", "published", "completed", "restored", "aborted"
]


@dataclass(frozen=True)
class Progress:
    """A progress report for a caller's display. `inflight` is set while draining the policy model."""

    checkpoint_id: str
    phase: str
    server: str | None = None
    inflight: int | None = None
    state: str | None = None


ProgressCallback = Callable[[Progress], None]


@dataclass(frozen=True)
class Outcome:
    """What a resume, abort or restore did: the servers in call order and where each one ended."""

    checkpoint_id: str | None
    outcome: str
    servers: tuple[str, ...] = ()
    resumed: tuple[str, ...] = ()
    not_paused: tuple[str, ...] = ()
    left_paused: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The `--json` document of `quiesce restore | resume | abort`."""
        return {"checkpoint_id": self.checkpoint_id, "outcome": self.outcome, "servers": list(self.servers)}


@dataclass
class Context:
    """What an attempt needs from its coordinator."""

    config: ClusterConfig
    ledger: Ledger
    caller: Caller
    on_progress: ProgressCallback | None = None

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
    `touched` lists, in first-contact order, every server a control request was sent to.
    """

    checkpoint_id: str
    kind: AttemptKind
    deadline_ts: float
    participants: tuple[Member, ...]
    staging_dir: Path | None = None
    snapshot: Path | None = None
    source_checkpoint_id: str | None = None
    state: AttemptState = "started"
    touched: list[str] = field(default_factory=list)
    commits: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: list[dict[str, str]] = field(default_factory=list)
    inflight: int | None = None
    last_server: str | None = None
    #: facts of the staging files read so far: publish does not read again what commit verified
    digests: DigestCache = field(default_factory=DigestCache, repr=False, compare=False)
    _touched: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._touched.update(self.touched)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.participants]

    def group(self, role: Role) -> tuple[Member, ...]:
        return tuple(m for m in self.participants if m.role == role)

    def member(self, name: str) -> Member | None:
        return next((m for m in self.participants if m.name == name), None)

    def touch(self, name: str) -> None:
        if name not in self._touched:
            self._touched.add(name)
            self.touched.append(name)


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


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _anyio_deadline(deadline_ts: float) -> float:
    """A wall-clock deadline (Unix seconds) on anyio's clock."""
    return anyio.current_time() + (deadline_ts - time.time())


def _common(attempt: Attempt, deadline_ts: float | None = None) -> CommonBody:
    return CommonBody(checkpoint_id=attempt.checkpoint_id, deadline_ts=deadline_ts or attempt.deadline_ts)


async def _call(
    ctx: Context,
    attempt: Attempt,
    member: Member,
    operation: str,
    phase: str,
    *,
    body: BaseModel | None = None,
    params: dict[str, Any] | None = None,
    deadline_ts: float | None = None,
) -> CallResult:
    """Send one control call for `attempt` (marks the server touched first)."""
    spec = route(member.component, operation)
    if spec.method == "POST":
        attempt.touch(member.name)
    attempt.last_server = member.name
    return await ctx.caller.call(
        member.target,
        spec,
        phase=phase,
        checkpoint_id=attempt.checkpoint_id,
        deadline_ts=deadline_ts or attempt.deadline_ts,
        body=body,
        params=params,
    )


def _expect(result: CallResult, model: type[T], phase: str, what: str) -> T:
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


async def _each(
    ctx: Context, members: Sequence[Member], fn: Callable[[Member], Awaitable[T]]
) -> dict[str, T]:
    """Run `fn` over one role group: one at a time, or concurrently with `fanout: parallel`.

    Sequential: stops at the first failure. Parallel: every call runs to its own end, then the
    first failure (in config order) is raised — siblings are never cancelled mid-call.
    """
    results: dict[str, T] = {}
    if ctx.config.fanout == "sequential" or len(members) <= 1:
        for member in members:
            results[member.name] = await fn(member)
        return results
    failures: dict[str, PhaseFailure] = {}

    async def one(member: Member) -> None:
        try:
            results[member.name] = await fn(member)
        except PhaseFailure as failure:
            failures[member.name] = failure

    async with anyio.create_task_group() as tg:
        for member in members:
            tg.start_soon(one, member)
    for member in members:
        if member.name in failures:
            raise failures[member.name]
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


async def run_phase(
    ctx: Context, attempt: Attempt, phase: str, body: Callable[[], Awaitable[dict[str, Any]]]
) -> dict[str, Any]:
    """Run one phase inside the attempt's deadline scope, with phase.started / phase.completed.

    Raises `PhaseFailure` (deadline=True when the scope expired) — the caller rolls back.
    """
    await ctx.ledger.stage("phase.started", checkpoint_id=attempt.checkpoint_id, data={"phase": phase})
    ctx.progress(Progress(attempt.checkpoint_id, phase))
    attempt.last_server = None
    summary: dict[str, Any] | None = None
    with anyio.CancelScope(deadline=_anyio_deadline(attempt.deadline_ts)) as scope:
        summary = await body()
    if scope.cancelled_caught or summary is None:
        reason = "the attempt's deadline passed"
        if phase == "prepare" and attempt.inflight:
            reason += f" while draining: {attempt.inflight} requests still in flight"
        # the call in flight when the deadline hit is the one that did not finish in time
        raise PhaseFailure(phase, attempt.last_server, reason, deadline=True)
    await ctx.ledger.stage(
        "phase.completed", checkpoint_id=attempt.checkpoint_id, data={"phase": phase, "summary": summary}
    )
    return summary


async def _rolled_back_on_failure(
    ctx: Context, attempt: Attempt, phase: str, body: Callable[[], Awaitable[None]]
) -> None:
    """Run `body`; on any failure before publication, roll back and raise.

    A phase failure raises the rollback's `PhaseError`. Anything else (the caller cancelled us, a
    bug) is rolled back too, shielded from cancellation, and re-raised with a note on what was
    done. `FencedError` is never handled: a fenced coordinator makes no further calls.
    """
    try:
        await body()
    except PhaseFailure as failure:
        raise await roll_back(ctx, attempt, failure) from None
    except FencedError:
        raise
    except BaseException as exc:
        interrupted = PhaseFailure(phase, attempt.last_server, f"interrupted by {type(exc).__name__}: {exc}")
        with anyio.CancelScope(shield=True):
            error = await roll_back(ctx, attempt, interrupted)
        exc.add_note(str(error))
        raise


async def _next_checkpoint_id(ledger: Ledger) -> str:
    """`e<epoch>-<seq>`: the seq its `attempt.started` will get (single writer), zero-padded."""
    return f"e{ledger.epoch}-{await ledger.last_seq() + 1:06d}"


# ---------------------------------------------------------------------------------------------
# Save: start, prepare, commit, publish
# ---------------------------------------------------------------------------------------------


async def start_attempt(ctx: Context, discovery: Discovery, *, deadline_s: float | None = None) -> Attempt:
    """Append `attempt.started` for a new save attempt and return it (nothing is called yet)."""
    checkpoint_id = await _next_checkpoint_id(ctx.ledger)
    deadline_ts = time.time() + (deadline_s if deadline_s is not None else ctx.config.deadline_s)
    staging = ctx.config.staging_root / checkpoint_id
    attempt = Attempt(
        checkpoint_id=checkpoint_id,
        kind="save",
        deadline_ts=deadline_ts,
        participants=discovery.participants,
        staging_dir=staging,
        skipped=[{"name": n, "reason": r} for n, r in discovery.skipped],
    )
    await ctx.ledger.stage(
        "attempt.started",
        checkpoint_id=checkpoint_id,
        data={
            "kind": "save",
            "deadline_ts": deadline_ts,
            "participants": attempt.names,
            "staging_dir": str(staging),
        },
        durable=True,  # see "Durability" in the module docstring
    )
    return attempt


async def prepare(ctx: Context, attempt: Attempt) -> None:
    """Prepare: policy pause → agents prepare → resources prepare → policy drain. Rolls back on failure."""
    _require(attempt, ("started",), "prepare")

    async def body() -> None:
        await run_phase(ctx, attempt, "prepare", lambda: _prepare_body(ctx, attempt))

    await _rolled_back_on_failure(ctx, attempt, "prepare", body)
    attempt.state = "prepared"


async def _prepare_body(ctx: Context, attempt: Attempt) -> dict[str, Any]:
    phase = "prepare"

    async def pause(m: Member) -> ModelPauseReply:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        result = await _call(ctx, attempt, m, "pause", phase, body=_common(attempt))
        return _expect(result, ModelPauseReply, phase, "policy pause")

    async def agent(m: Member) -> AgentPrepareReply:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        while True:
            result = await _call(ctx, attempt, m, "prepare", phase, body=_common(attempt))
            if result.error == "http" and result.status == 409 and result.code == _AGENT_PREPARE_INCOMPLETE:
                left = attempt.deadline_ts - time.time()
                if left <= AGENT_RETRY_S:
                    raise PhaseFailure(
                        phase,
                        m.name,
                        "agent never became ready to commit before the deadline (agent_prepare_incomplete)",
                        result.code,
                        deadline=True,
                    )
                await anyio.sleep(min(AGENT_RETRY_S, left))
                continue
            reply = _expect(result, AgentPrepareReply, phase, "agent prepare")
            if not reply.ready_to_commit:
                raise PhaseFailure(phase, m.name, "agent prepare answered but is not ready_to_commit")
            return reply

    async def resources(m: Member) -> ResourcesPrepareReply:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        result = await _call(ctx, attempt, m, "prepare", phase, body=_common(attempt))
        return _expect(result, ResourcesPrepareReply, phase, "resources prepare")

    pauses = await _each(ctx, attempt.group("policy"), pause)
    agents = await _each(ctx, attempt.group("agent"), agent)
    res = await _each(ctx, attempt.group("resources"), resources)
    drained = await _each(
        ctx, attempt.group("policy"), lambda m: _drain(ctx, attempt, m, pauses[m.name].workers)
    )
    return {
        "policy": {name: {"inflight_at_pause": p.inflight_total} for name, p in pauses.items()},
        "drain": drained,
        "agents": {name: {"parked": a.parked, "active": a.active} for name, a in agents.items()},
        "resources": {name: {"sessions": r.sessions} for name, r in res.items()},
    }


async def _drain(ctx: Context, attempt: Attempt, m: Member, workers: Workers) -> dict[str, Any]:
    """Repeat the status long-poll (each ≤ the time left) until paused, nothing in flight, all workers."""
    phase = "prepare"
    polls = 0
    while True:
        left = attempt.deadline_ts - time.time()
        wait = max(0.0, min(DRAIN_POLL_S, left - POLL_MARGIN_S))
        query = StatusQuery(
            checkpoint_id=attempt.checkpoint_id,
            deadline_ts=attempt.deadline_ts,
            wait_state="paused",
            timeout_s=wait,
        )
        started = time.monotonic()
        result = await _call(ctx, attempt, m, "status", phase, params=query.model_dump(exclude_none=True))
        polls += 1
        reply = _expect(result, ModelStatusReply, phase, "policy status")
        attempt.inflight = reply.inflight_total
        ctx.progress(
            Progress(attempt.checkpoint_id, phase, m.name, inflight=reply.inflight_total, state=reply.state)
        )
        workers_paused = all(w.state == "paused" for w in reply.per_worker.values())
        acknowledged = workers.acknowledged >= workers.expected or (
            len(reply.per_worker) >= workers.expected and workers_paused
        )
        if reply.state == "paused" and reply.inflight_total == 0 and workers_paused and acknowledged:
            return {"polls": polls, "state": reply.state}
        if attempt.deadline_ts - time.time() <= POLL_MARGIN_S:
            # no time for another poll whose reply could arrive before the deadline: the drain
            # waits the deadline out (sending nothing after it), then fails
            await anyio.sleep(max(0.0, attempt.deadline_ts - time.time()))
            raise PhaseFailure(
                phase,
                m.name,
                f"the drain did not finish before the deadline: {reply.inflight_total} requests"
                f" still in flight (state {reply.state})",
                deadline=True,
            )
        if time.monotonic() - started < 0.01:
            await anyio.sleep(0.05)


async def commit(ctx: Context, attempt: Attempt) -> None:
    """Commit: agents → policy (with every agent's continuation index) → resources; each role
    group's manifest digests and artifact references are verified before the next group is called.

    The staging folder is created (durably) first; a failure rolls back and removes it.
    """
    _require(attempt, ("prepared",), "commit")
    assert attempt.staging_dir is not None
    staging = attempt.staging_dir

    async def body() -> None:
        try:
            await anyio.to_thread.run_sync(make_staging, staging)
        except OSError as error:
            raise PhaseFailure(
                "commit", None, f"cannot create the staging folder {staging}: {error}"
            ) from None
        await run_phase(ctx, attempt, "commit", lambda: _commit_body(ctx, attempt))

    await _rolled_back_on_failure(ctx, attempt, "commit", body)
    attempt.state = "committed"


async def _commit_body(ctx: Context, attempt: Attempt) -> dict[str, Any]:
    phase = "commit"
    staging = attempt.staging_dir
    assert staging is not None
    checkpoint_dir = str(staging)

    def dir_body() -> CheckpointDirBody:
        return CheckpointDirBody(
            checkpoint_id=attempt.checkpoint_id,
            deadline_ts=attempt.deadline_ts,
            checkpoint_dir=checkpoint_dir,
        )

    def record(m: Member, reply: BaseModel, digest: str, refs: dict[str, ArtifactRef | None]) -> None:
        entry: dict[str, Any] = {
            "name": m.name,
            "component": m.component,
            "role": m.role,
            "manifest": manifest_path(m.component, m.name),
            "manifest_digest": digest,
            "reply": reply.model_dump(mode="json"),
        }
        for key, ref in refs.items():
            if ref is not None:
                entry[key] = ref.model_dump(mode="json")
        attempt.commits[m.name] = entry

    async def verify(group: Sequence[Member]) -> None:
        # one pass (one worker thread) per role group, before the next group is called: the
        # agents' continuation indexes are checked before they go to the model's commit
        entries = [attempt.commits[m.name] for m in group if m.name in attempt.commits]

        def check() -> list[tuple[str, list[str]]]:
            return [(e["name"], _verify_entry(staging, e, attempt.digests)) for e in entries]

        for name, problems in await anyio.to_thread.run_sync(check):
            if problems:
                raise PhaseFailure(phase, name, "; ".join(problems))

    async def agent(m: Member) -> AgentCommitReply:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        result = await _call(ctx, attempt, m, "commit", phase, body=dir_body())
        reply = _expect(result, AgentCommitReply, phase, "agent commit")
        record(m, reply, reply.manifest_digest, {"continuation_index": reply.continuation_index})
        return reply

    agents = await _each(ctx, attempt.group("agent"), agent)
    await verify(attempt.group("agent"))
    indexes = [agents[m.name].continuation_index for m in attempt.group("agent")]

    async def policy(m: Member) -> ModelCommitReply:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        body = ModelCommitBody(
            checkpoint_id=attempt.checkpoint_id,
            deadline_ts=attempt.deadline_ts,
            checkpoint_dir=checkpoint_dir,
            continuation_indexes=indexes,
        )
        result = await _call(ctx, attempt, m, "commit", phase, body=body)
        reply = _expect(result, ModelCommitReply, phase, "model commit")
        record(m, reply, reply.manifest_digest, {"storage_reference_index": reply.storage_reference_index})
        return reply

    async def resources(m: Member) -> ResourcesCommitReply:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        result = await _call(ctx, attempt, m, "commit", phase, body=dir_body())
        reply = _expect(result, ResourcesCommitReply, phase, "resources commit")
        record(m, reply, reply.manifest_digest, {})
        return reply

    models = await _each(ctx, attempt.group("policy"), policy)
    await verify(attempt.group("policy"))
    res = await _each(ctx, attempt.group("resources"), resources)
    await verify(attempt.group("resources"))
    return {
        "agents": {n: {"records": a.records} for n, a in agents.items()},
        "policy": {n: {"rollouts": p.rollouts, "rows": p.rows} for n, p in models.items()},
        "resources": {n: {"sessions": r.sessions} for n, r in res.items()},
    }


def _verify_entry(staging: Path, entry: dict[str, Any], cache: DigestCache | None = None) -> list[str]:
    """A participant's manifest digest and artifact references against the files in `staging`
    (read now, or taken from `cache` for a file unchanged since it was read)."""
    name = entry["name"]
    problems: list[str] = []
    rel = entry["manifest"]
    facts = regular_facts(staging / rel, cache=cache)  # no symlink: the tree's digests leave them out
    digest = facts.sha256 if not isinstance(facts, str) else None
    if isinstance(facts, str):
        unreadable = facts.startswith("cannot be read")
        problems.append(f"{name}: its manifest {rel} {facts if unreadable else 'is missing'}")
    if digest is not None and digest != entry["manifest_digest"]:
        problems.append(
            f"{name}: manifest_digest {entry['manifest_digest'][:12]}… does not match the sha256 of {rel}"
            f" ({digest[:12]}…)"
        )
    for key in ("continuation_index", "storage_reference_index"):
        if key in entry:
            try:
                ref = ArtifactRef.model_validate(entry[key])
            except ValidationError:
                problems.append(f"{name}: {key} is not a valid artifact reference")
                continue
            problem = verify_artifact(staging, ref, what=f"{name} {key}", cache=cache)
            if problem:
                problems.append(problem)
    return problems


def final_dir_of(staging: Path) -> Path:
    """Where a save's staging folder `<snapshots>/.staging/<id>` is renamed to: `<snapshots>/<id>`.

    The one rule `publish` and recovery share. It reads only the staging folder, which the durable
    `attempt.started` records, so recovery finds a publication even when the ledger kept no
    `attempt.publishing` and the configured snapshot folder has changed since."""
    return staging.parent.parent / staging.name


async def publish(ctx: Context, attempt: Attempt, *, defer_delete: bool = False) -> Path:
    """Verify, write the manifest, rename into place (the commit point), point LATEST, retention.

    With `defer_delete`, retention only moves the snapshots it removes into the trash; the caller
    deletes them (`publish.empty_trash`), e.g. while the servers resume.

    `attempt.publishing` is staged once the manifest is on disk, `attempt.published` after the
    rename and its fsync; both ride with the next append (the first resume request's `call.sent`),
    so the rename waits for no transaction: the fsynced rename decides publication, and recovery
    reads it from the filesystem whatever the ledger kept (`settle_publication`). A failure before
    the rename rolls back like a failed commit; after it, the snapshot is published whatever
    happens next.
    """
    _require(attempt, ("committed",), "publish")
    staging = attempt.staging_dir
    assert staging is not None
    final = final_dir_of(staging)
    await ctx.ledger.stage("phase.started", checkpoint_id=attempt.checkpoint_id, data={"phase": "publish"})
    ctx.progress(Progress(attempt.checkpoint_id, "publish"))
    written: list[bytes] = []
    manifests: list[dict[str, Any]] = []

    async def body() -> None:
        entries = list(attempt.commits.values())

        def verify() -> tuple[dict[str, tuple[int, str]], list[str]]:
            # one pass hashes (what commit did not) and fsyncs every file and folder; the checks
            # and the manifest reuse it
            cache = attempt.digests
            digests = tree_digests(staging, sync=True, skip=[MANIFEST], cache=cache)
            return digests, [p for entry in entries for p in _verify_entry(staging, entry, cache)]

        try:
            digests, problems = await anyio.to_thread.run_sync(verify)
        except OSError as error:
            raise PhaseFailure(
                "publish", None, f"cannot read the staging folder {staging}: {error}"
            ) from None
        if problems:
            first = next(iter(attempt.commits))
            server = next(
                (
                    e["name"]
                    for e in attempt.commits.values()
                    if problems[0].split(":")[0].split(" ")[0] == e["name"]
                ),
                first,
            )
            raise PhaseFailure("publish", server, "; ".join(problems))
        ledger_seq = await ctx.ledger.last_seq()
        try:
            manifest = await anyio.to_thread.run_sync(
                lambda: build_manifest(
                    staging,
                    checkpoint_id=attempt.checkpoint_id,
                    created=utc_now(),
                    epoch=ctx.ledger.epoch,
                    ledger_seq=ledger_seq,
                    participants=list(attempt.commits.values()),
                    skipped=attempt.skipped,
                    digests=digests,
                )
            )
        except OSError as error:
            raise PhaseFailure(
                "publish", None, f"cannot write the snapshot manifest in {staging}: {error}"
            ) from None
        try:
            written.append(await anyio.to_thread.run_sync(write_json_durably, staging / MANIFEST, manifest))
        except OSError as error:
            raise PhaseFailure(
                "publish", None, f"cannot write the snapshot manifest in {staging}: {error}"
            ) from None
        # staged, not committed before the rename: whether the rename happened is read from the
        # filesystem, never from the ledger (`settle_publication`)
        await ctx.ledger.stage(
            "attempt.publishing",
            checkpoint_id=attempt.checkpoint_id,
            data={"staging_dir": str(staging), "final_dir": str(final)},
        )
        manifests.append(manifest)
        attempt.state = "publishing"
        try:
            await anyio.to_thread.run_sync(rename_into_place, staging, final)
        except (OSError, SnapshotError) as error:
            # the rename is the commit point: if it happened (the error came after it), it is published
            if staging.exists() or not (final / MANIFEST).is_file():
                raise PhaseFailure("publish", None, f"cannot rename {staging} to {final}: {error}") from None

    try:
        await _rolled_back_on_failure(ctx, attempt, "publish", body)
    finally:
        attempt.digests.clear()  # read only by commit's checks and publish's: not kept past them
    manifest = manifests[0]
    await ctx.ledger.stage(
        "attempt.published",
        checkpoint_id=attempt.checkpoint_id,
        data={"final_dir": str(final), "manifest_sha256": hashlib.sha256(written[0]).hexdigest()},
    )
    attempt.state = "published"
    attempt.snapshot = final
    await anyio.to_thread.run_sync(write_latest, ctx.config.snapshots, final.name)
    removed = await anyio.to_thread.run_sync(
        lambda: apply_retention(
            ctx.config.snapshots, ctx.config.keep_latest, protect=[final], defer_delete=defer_delete
        )
    )
    swept = await _sweep_finished(ctx)
    await ctx.ledger.stage(
        "phase.completed",
        checkpoint_id=attempt.checkpoint_id,
        data={
            "phase": "publish",
            "summary": {
                "final_dir": str(final),
                "files": len(manifest["files"]),
                "retention_removed": [p.name for p in removed],
                "staging_swept": [p.name for p in swept],
            },
        },
    )
    return final


async def _sweep_finished(ctx: Context) -> list[Path]:
    """Remove the staging folders of finished attempts (a rename leaves none of its own behind).

    Only the checkpoint ids found under the staging root are looked up, so a publish costs no
    ledger read while that root is empty — the usual case — however long the history.
    """
    root = ctx.config.staging_root

    def names() -> list[str]:
        return [p.name for p in root.iterdir() if p.is_dir()] if root.is_dir() else []

    found = await anyio.to_thread.run_sync(names)
    if not found:
        return []
    finished = []
    for name in found:
        row = await ctx.ledger.attempt(name)
        if row is not None and row.outcome is not None:
            finished.append(name)
    return await anyio.to_thread.run_sync(sweep_staging, root, finished) if finished else []


# ---------------------------------------------------------------------------------------------
# Resume and rollback
# ---------------------------------------------------------------------------------------------


async def resume_members(
    ctx: Context, attempt: Attempt, names: Sequence[str], *, phase: str, deadline_ts: float
) -> tuple[list[str], list[str], list[str], list[str], list[tuple[str, CallResult]]]:
    """Resume `names` in resume order (fan-out within a group). Never stops early.

    Returns (called in order, resumed, not_paused, left_paused, failures).
    """
    wanted = set(names)
    called: list[str] = []
    resumed: list[str] = []
    not_paused: list[str] = []
    failures: list[tuple[str, CallResult]] = []

    async def one(m: Member) -> None:
        called.append(m.name)
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        body = CommonBody(checkpoint_id=attempt.checkpoint_id, deadline_ts=deadline_ts)
        result = await _call(ctx, attempt, m, "resume", phase, body=body, deadline_ts=deadline_ts)
        if result.ok:
            resumed.append(m.name)
        elif result.error == "http" and result.status == 409 and result.code == INVALID_PHASE:
            not_paused.append(m.name)
        else:
            failures.append((m.name, result))

    with anyio.CancelScope(deadline=_anyio_deadline(deadline_ts)):
        for role in resume_order():
            members = [m for m in attempt.group(role) if m.name in wanted]
            if ctx.config.fanout == "parallel" and len(members) > 1:
                async with anyio.create_task_group() as tg:
                    for m in members:
                        tg.start_soon(one, m)
            else:
                for m in members:
                    await one(m)
    # whoever is neither resumed nor known never-paused is left paused: a failed call, the budget
    # running out before (or during) its call, or a server the config no longer names
    settled = set(resumed) | set(not_paused)
    left = [n for n in names if n not in settled]
    return called, resumed, not_paused, left, failures


def _recovery_budget(ctx: Context, attempt: Attempt) -> float:
    return max(attempt.deadline_ts, time.time() + ctx.config.control_timeout_s)


async def roll_back(
    ctx: Context, attempt: Attempt, failure: PhaseFailure | None, *, reason: str | None = None
) -> PhaseError:
    """Resume every touched server (resume order), remove staging, record; return the error to raise.

    Save attempts only (a failed restore is recorded by `restore` and left paused). The budget is
    `max(deadline_ts, now + control_timeout_s)`; 409 `invalid_phase` means the server never paused.
    """
    text = reason or (
        f"{failure.phase} failed at {failure.server or 'the coordinator'}: {failure.reason}"
        if failure
        else "aborted"
    )
    if failure is not None:
        await record_phase_failed(
            ctx, attempt.checkpoint_id, failure.phase, failure.server, failure.reason, failure.code
        )
    await ctx.ledger.stage("attempt.aborting", checkpoint_id=attempt.checkpoint_id, data={"reason": text})
    budget = _recovery_budget(ctx, attempt)
    _, resumed, not_paused, left, _ = await resume_members(
        ctx, attempt, list(attempt.touched), phase="rollback", deadline_ts=budget
    )
    if attempt.staging_dir is not None:
        await anyio.to_thread.run_sync(remove_tree, attempt.staging_dir)
    await ctx.ledger.append(
        "attempt.aborted",
        checkpoint_id=attempt.checkpoint_id,
        data={"reason": text, "resumed": resumed, "left_paused": left, "not_paused": not_paused},
    )
    attempt.state = "aborted"
    latest = read_latest(ctx.config.snapshots)
    phase = failure.phase if failure else "abort"
    message = (
        f"checkpoint {attempt.checkpoint_id} rolled back: {text}."
        f" Resumed: {', '.join(resumed) or 'none'}."
        + (f" Never paused: {', '.join(not_paused)}." if not_paused else "")
        + (
            f" Could not resume: {', '.join(left)} — run `quiesce resume` once they are reachable."
            if left
            else " Every server is accepting again."
        )
        + f" Latest snapshot: {latest if latest else 'none'}."
    )
    cls = DeadlineExceeded if failure is not None and failure.deadline else PhaseError
    return cls(
        message,
        phase=phase,
        server=failure.server if failure else None,
        reason=failure.reason if failure else text,
        code=failure.code if failure else None,
        checkpoint_id=attempt.checkpoint_id,
        resumed=resumed + not_paused,
        not_resumed=left,
        latest_snapshot=str(latest) if latest else None,
    )


async def finish_resume(ctx: Context, attempt: Attempt) -> Outcome:
    """Resume every participant of a published save, or of a restore; then `attempt.completed`.

    Servers that cannot be resumed leave the attempt without a terminal event (so the same id's
    resume can be retried) and raise `PhaseError` naming them.
    """
    budget = _recovery_budget(ctx, attempt)
    await ctx.ledger.stage("phase.started", checkpoint_id=attempt.checkpoint_id, data={"phase": "resume"})
    called, resumed, not_paused, left, failures = await resume_members(
        ctx, attempt, attempt.names, phase="resume", deadline_ts=budget
    )
    if left:
        name = left[0]
        detail = next((r.describe() for n, r in failures if n == name), "no time left to call it")
        code = next((r.code for n, r in failures if n == name), None)
        await record_phase_failed(ctx, attempt.checkpoint_id, "resume", name, detail, code)
        latest = read_latest(ctx.config.snapshots)
        raise PhaseError(
            f"resume of {attempt.checkpoint_id} failed at {name}: {detail}."
            f" Resumed: {', '.join(resumed) or 'none'}; still paused: {', '.join(left)}."
            " Run `quiesce resume` again once they are reachable."
            f" Latest snapshot: {latest if latest else 'none'}.",
            phase="resume",
            server=name,
            reason=detail,
            code=code,
            checkpoint_id=attempt.checkpoint_id,
            resumed=resumed + not_paused,
            not_resumed=left,
            latest_snapshot=str(latest) if latest else None,
        )
    await ctx.ledger.stage(
        "phase.completed",
        checkpoint_id=attempt.checkpoint_id,
        data={"phase": "resume", "summary": {"resumed": resumed, "not_paused": not_paused}},
    )
    outcome: Literal["published", "resumed"] = "published" if attempt.kind == "save" else "resumed"
    # write-behind: what it answers is already durable — the fsynced snapshot (a save), or the
    # servers' own resumed state; were it lost with a power failure, recovery finds the
    # publication on disk, resumes again (the servers replay) and records it again
    await ctx.ledger.append(
        "attempt.completed",
        checkpoint_id=attempt.checkpoint_id,
        data={"servers": called, "outcome": outcome},
        durable=False,
    )
    attempt.state = "completed"
    return Outcome(attempt.checkpoint_id, outcome, tuple(called), tuple(resumed), tuple(not_paused), ())


def _require(attempt: Attempt, states: tuple[str, ...], step: str) -> None:
    if attempt.state not in states:
        raise QuiesceError(
            f"cannot {step} checkpoint {attempt.checkpoint_id}: it is {attempt.state}"
            f" (expected {' or '.join(states)})"
        )


# ---------------------------------------------------------------------------------------------
# Restore
# ---------------------------------------------------------------------------------------------


async def restore(
    ctx: Context, discovery: Discovery, snapshot: Snapshot, *, deadline_s: float | None = None
) -> Attempt:
    """Restore a verified snapshot: policy → agents → resources under a new id; servers stay paused.

    The caller verifies the snapshot first (`publish.verify_snapshot`) — before any call. Replies are
    checked against the snapshot: source checkpoint id, and each agent's continuation index.
    """
    checkpoint_id = await _next_checkpoint_id(ctx.ledger)
    deadline_ts = time.time() + (deadline_s if deadline_s is not None else ctx.config.deadline_s)
    attempt = Attempt(
        checkpoint_id=checkpoint_id,
        kind="restore",
        deadline_ts=deadline_ts,
        participants=discovery.participants,
        snapshot=snapshot.path,
        source_checkpoint_id=snapshot.checkpoint_id,
    )
    await ctx.ledger.stage(
        "attempt.started",
        checkpoint_id=checkpoint_id,
        data={
            "kind": "restore",
            "deadline_ts": deadline_ts,
            "participants": attempt.names,
            "snapshot_dir": str(snapshot.path),
            "source_checkpoint_id": snapshot.checkpoint_id,
        },
        durable=True,  # see "Durability" in the module docstring
    )
    try:
        await run_phase(ctx, attempt, "restore", lambda: restore_body(ctx, attempt, snapshot))
    except FencedError:
        raise
    except PhaseFailure as failure:
        await record_phase_failed(ctx, checkpoint_id, "restore", failure.server, failure.reason, failure.code)
        reason = f"restore failed at {failure.server or 'the coordinator'}: {failure.reason}"
        await ctx.ledger.append(
            "attempt.aborted",
            checkpoint_id=checkpoint_id,
            data={"reason": reason, "resumed": [], "left_paused": list(attempt.touched), "not_paused": []},
        )
        attempt.state = "aborted"
        cls = DeadlineExceeded if failure.deadline else PhaseError
        raise cls(
            f"restore {checkpoint_id} of snapshot {snapshot.path} failed: {reason}. Servers contacted stay"
            f" paused (half-restored state must not run): {', '.join(attempt.touched) or 'none'}."
            " Restart them and restore again, or run `quiesce resume` to run them as they are.",
            phase="restore",
            server=failure.server,
            reason=failure.reason,
            code=failure.code,
            checkpoint_id=checkpoint_id,
            resumed=[],
            not_resumed=list(attempt.touched),
            latest_snapshot=str(read_latest(ctx.config.snapshots) or "") or None,
        ) from None
    except BaseException as exc:  # cancelled or a bug: record what is left paused, then re-raise
        with anyio.CancelScope(shield=True):
            await ctx.ledger.append(
                "attempt.aborted",
                checkpoint_id=checkpoint_id,
                data={
                    "reason": f"restore interrupted: {type(exc).__name__}: {exc}",
                    "resumed": [],
                    "left_paused": list(attempt.touched),
                    "not_paused": [],
                },
            )
        attempt.state = "aborted"
        raise
    await ctx.ledger.append(
        "attempt.completed",
        checkpoint_id=checkpoint_id,
        data={"servers": attempt.touched, "outcome": "restored"},
    )
    attempt.state = "restored"
    return attempt


async def restore_body(ctx: Context, attempt: Attempt, snapshot: Snapshot) -> dict[str, Any]:
    """The restore phase: policy → agents → resources, each reply checked against the snapshot."""
    phase = "restore"
    source = snapshot.checkpoint_id
    body = CheckpointDirBody(
        checkpoint_id=attempt.checkpoint_id,
        deadline_ts=attempt.deadline_ts,
        checkpoint_dir=str(snapshot.path),
    )

    async def policy(m: Member) -> dict[str, Any]:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        reply = _expect(
            await _call(ctx, attempt, m, "restore", phase, body=body),
            ModelRestoreReply,
            phase,
            "model restore",
        )
        if reply.checkpoint_id != source:
            raise PhaseFailure(
                phase, m.name, f"restored checkpoint {reply.checkpoint_id!r}, the snapshot is {source!r}"
            )
        return {"rollouts": reply.rollouts, "rows": reply.rows}

    async def agent(m: Member) -> dict[str, Any]:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        reply = _expect(
            await _call(ctx, attempt, m, "restore", phase, body=body),
            AgentRestoreReply,
            phase,
            "agent restore",
        )
        if reply.source_checkpoint_id != source:
            raise PhaseFailure(
                phase,
                m.name,
                f"restored checkpoint {reply.source_checkpoint_id!r}, the snapshot is {source!r}",
            )
        committed = (snapshot.participant(m.name) or {}).get("continuation_index")
        got = reply.continuation_index.model_dump(mode="json")
        keys = ("relative_path", "sha256", "records", "bytes")
        if not isinstance(committed, dict) or any(committed.get(k) != got.get(k) for k in keys):
            raise PhaseFailure(
                phase, m.name, "its continuation index differs from the one committed in the snapshot"
            )
        return {"records": reply.records}

    async def resources(m: Member) -> dict[str, Any]:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        reply = _expect(
            await _call(ctx, attempt, m, "restore", phase, body=body),
            ResourcesRestoreReply,
            phase,
            "resources restore",
        )
        if reply.source_checkpoint_id != source:
            raise PhaseFailure(
                phase,
                m.name,
                f"restored checkpoint {reply.source_checkpoint_id!r}, the snapshot is {source!r}",
            )
        return {"sessions": reply.sessions}

    return {
        "policy": await _each(ctx, attempt.group("policy"), policy),
        "agents": await _each(ctx, attempt.group("agent"), agent),
        "resources": await _each(ctx, attempt.group("resources"), resources),
    }


# ---------------------------------------------------------------------------------------------
# Rebuilding from the ledger (another process: `quiesce resume | abort`)
# ---------------------------------------------------------------------------------------------


@dataclass
class Recorded:
    """What the ledger says about one attempt."""

    attempt: Attempt
    events: list[Event]
    publishing: dict[str, Any] | None = None
    published: dict[str, Any] | None = None
    terminal: list[Event] = field(default_factory=list)

    @property
    def paused(self) -> list[str]:
        """Servers this attempt may have left paused, by the last terminal event (empty if none)."""
        if not self.terminal:
            return list(self.attempt.touched)
        last = self.terminal[-1]
        if last.kind == "attempt.completed" and last.data.get("outcome") == "restored":
            return self.attempt.names
        if last.kind == "attempt.aborted":
            value = last.data.get("left_paused")
            return [str(v) for v in value] if isinstance(value, list) else []
        return []


async def load_attempt(ctx: Context, checkpoint_id: str) -> Recorded:
    """Rebuild an attempt from its events.

    Components come from the discovery before it; URLs from the config.
    """
    events = [ev async for ev in ctx.ledger.read(checkpoint_id=checkpoint_id)]
    started = next((ev for ev in events if ev.kind == "attempt.started"), None)
    if started is None:
        raise QuiesceError(f"the ledger has no attempt {checkpoint_id}")
    discovered: dict[str, dict[str, Any]] = {}
    async for ev in ctx.ledger.read(kinds=["discovery.completed"]):
        if ev.seq > started.seq:
            break
        discovered = {str(p["name"]): p for p in ev.data.get("participants", []) if isinstance(p, dict)}
    members: list[Member] = []
    for name in started.data.get("participants", []):
        info = discovered.get(name, {})
        configured = ctx.config.server(name)
        component = str(info.get("component", ""))
        role = info.get("role")
        url = configured.url if configured else str(info.get("url", ""))
        if component in (MODEL, AGENT, RESOURCES) and role in ("policy", "agent", "resources") and url:
            members.append(
                Member(
                    name,
                    component,
                    str(info.get("mode", "")),
                    "policy" if role == "policy" else None,
                    role,
                    url,
                )
            )
    data = started.data
    attempt = Attempt(
        checkpoint_id=checkpoint_id,
        kind="restore" if data.get("kind") == "restore" else "save",
        deadline_ts=float(data.get("deadline_ts", 0.0)),
        participants=tuple(members),
        staging_dir=Path(data["staging_dir"]) if data.get("staging_dir") else None,
        snapshot=Path(data["snapshot_dir"]) if data.get("snapshot_dir") else None,
        source_checkpoint_id=data.get("source_checkpoint_id"),
    )
    recorded = Recorded(attempt, events)
    for ev in events:
        if ev.kind == "call.sent" and ev.server is not None and ev.data.get("method") == "POST":
            attempt.touch(ev.server)
        elif ev.kind == "attempt.publishing":
            recorded.publishing = ev.data
        elif ev.kind == "attempt.published":
            recorded.published = ev.data
            attempt.snapshot = Path(ev.data["final_dir"])
        elif ev.kind in ("attempt.completed", "attempt.aborted"):
            recorded.terminal.append(ev)
    if recorded.terminal:
        last = recorded.terminal[-1]
        attempt.state = "aborted" if last.kind == "attempt.aborted" else "completed"
        if last.kind == "attempt.completed" and last.data.get("outcome") == "restored":
            attempt.state = "restored"
    elif recorded.published is not None:
        attempt.state = "published"
    elif recorded.publishing is not None:
        attempt.state = "publishing"
    return recorded


async def find_paused(ctx: Context, *, in_progress_only: bool = False) -> Recorded | None:
    """The newest attempt that may have left servers paused.

    That is an attempt without a terminal event; or (unless `in_progress_only`) a restore completed
    but not resumed, or an attempt whose rollback left servers paused.
    """
    rows = await ctx.ledger.attempts()
    for row in sorted(rows, key=lambda r: r.last_seq, reverse=True):
        if row.outcome is None:
            return await load_attempt(ctx, row.checkpoint_id)
        if in_progress_only or row.outcome not in ("restored", "aborted"):
            continue
        recorded = await load_attempt(ctx, row.checkpoint_id)
        if recorded.paused:
            return recorded
    return None


async def settle_publication(ctx: Context, recorded: Recorded) -> bool:
    """An unfinished save without `attempt.published`: the filesystem decides whether it was published.

    The final folder (the one `attempt.publishing` names, else `final_dir_of` the staging folder
    `attempt.started` records) with a manifest naming this checkpoint id means published
    (recorded now, LATEST updated); otherwise not. Returns whether it is published. The folder is
    looked for even when the ledger has no `attempt.publishing`: that record is staged, so a crash
    right after the rename loses it while the fsynced rename survives.
    """
    attempt = recorded.attempt
    if recorded.published is not None:
        return True
    if recorded.publishing is not None:
        final = Path(recorded.publishing["final_dir"])
    elif attempt.staging_dir is not None:
        final = final_dir_of(attempt.staging_dir)
    else:
        return False
    try:
        snapshot = await anyio.to_thread.run_sync(load_snapshot, final)
    except SnapshotError:
        return False
    if snapshot.checkpoint_id != attempt.checkpoint_id:
        return False
    _, digest = await anyio.to_thread.run_sync(file_digest, final / MANIFEST)
    await ctx.ledger.stage(
        "attempt.published",
        checkpoint_id=attempt.checkpoint_id,
        data={"final_dir": str(final), "manifest_sha256": digest},
    )
    await anyio.to_thread.run_sync(write_latest, final.parent, final.name)
    recorded.published = {"final_dir": str(final), "manifest_sha256": digest}
    attempt.snapshot = final
    attempt.state = "published"
    return True


async def resume_recorded(ctx: Context, recorded: Recorded, *, reason: str) -> Outcome:
    """Resume what a recorded attempt left paused (another process's, or this one's).

    - published save (or publication found on disk): resume every participant → `published`;
    - otherwise in progress: roll back (resume touched) → `aborted`;
    - restore completed, or rolled back leaving servers paused: resume them → `resumed`.
    """
    attempt = recorded.attempt
    if not recorded.terminal:
        if attempt.kind == "save" and await settle_publication(ctx, recorded):
            return await finish_resume(ctx, attempt)
        error = await roll_back(ctx, attempt, None, reason=reason)
        return Outcome(
            attempt.checkpoint_id,
            "aborted",
            tuple(n for n in resume_sorted(attempt, attempt.touched)),
            tuple(n for n in error.resumed),
            (),
            tuple(error.not_resumed),
        )
    paused = recorded.paused
    if not paused:
        return Outcome(attempt.checkpoint_id, "none")
    last = recorded.terminal[-1]
    if last.kind == "attempt.completed" and last.data.get("outcome") == "restored":
        return await finish_resume(ctx, attempt)
    budget = _recovery_budget(ctx, attempt)
    await ctx.ledger.stage("phase.started", checkpoint_id=attempt.checkpoint_id, data={"phase": "resume"})
    called, resumed, not_paused, left, failures = await resume_members(
        ctx, attempt, paused, phase="resume", deadline_ts=budget
    )
    if left:
        name = left[0]
        detail = next((r.describe() for n, r in failures if n == name), "no time left to call it")
        await record_phase_failed(ctx, attempt.checkpoint_id, "resume", name, detail, None)
        raise PhaseError(
            f"resume of {attempt.checkpoint_id} failed at {name}: {detail}. Still paused: {', '.join(left)}.",
            phase="resume",
            server=name,
            reason=detail,
            checkpoint_id=attempt.checkpoint_id,
            resumed=resumed + not_paused,
            not_resumed=left,
        )
    await ctx.ledger.stage(
        "phase.completed",
        checkpoint_id=attempt.checkpoint_id,
        data={"phase": "resume", "summary": {"resumed": resumed, "not_paused": not_paused}},
    )
    await ctx.ledger.append(
        "attempt.completed",
        checkpoint_id=attempt.checkpoint_id,
        data={"servers": called, "outcome": "resumed"},
    )
    return Outcome(attempt.checkpoint_id, "resumed", tuple(called), tuple(resumed), tuple(not_paused), ())


def resume_sorted(attempt: Attempt, names: Sequence[str]) -> list[str]:
    order = {role: i for i, role in enumerate(resume_order())}
    return sorted(names, key=lambda n: order.get(m.role, 99) if (m := attempt.member(n)) else 99)
