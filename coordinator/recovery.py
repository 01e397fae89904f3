"""Recovery after coordinator death: what the next coordinator does with a dead one's attempts.

Run by `Coordinator.open` (after it took its epoch, so the dead coordinator is fenced) and by
`quiesce recover`. For every unfinished attempt (`readback.unfinished`: no terminal record, or a
restore whose resume began after it was left paused), in the order of their last event:

1. **Settle** each server the attempt touched (or, for a publication, every participant): read
   its capabilities through `calls.py` (phase `recovery`, recorded like every call) — its fence
   phase and active checkpoint id. *Touched* is a server with a `call.sent` in the ledger, or a
   participant without one that reports this checkpoint id as active: `call.sent` is
   write-behind, so after a power failure the ledger may have lost the last ones, but never the
   durable `attempt.started` that lists every participant (see attempt.py, "Durability"). Rolling back a save,
   an agent or resources participant at `idle` counts as touched too (a prepare it refused
   leaves no trace in its capabilities; see `_settle_touched`). Any other participant that shows
   no trace of the attempt (or cannot be read) is left alone and not reported. A server
   still inside an operation of this attempt (`committing`, `restoring`, a resources server's
   `preparing`, with this id active: the dead coordinator's request is still running there) is
   read again until it leaves that phase, at most until `max(deadline_ts, now) +
   control_timeout_s` — past the deadline the server's own operation honours — since a resume
   there is refused, and taking that refusal for "never paused" left the server paused for good
   once its operation ended. One still inside it at the end is not resumed: it is reported
   `left_paused`, saying its operation is still running (`resume.operation_running`).
2. **Act**, by what the ledger and the filesystem say:
   - *save*: the filesystem decides first, whatever the ledger kept of the publish step
     (`attempt.publishing` is staged: the rename does not wait for it, so a crash may take it
     while the fsynced rename survives). The final folder (named by `attempt.publishing`, else
     `<snapshots>/<checkpoint_id>` derived from the staging folder that `attempt.started` records)
     with a manifest naming this checkpoint id means published: `attempt.published` is recorded
     (if it was not), `LATEST` points at it, retention runs, and every participant is resumed
     (phase `resume`, `attempt.completed {outcome: published}`).
   - *save, not published*: abort. `attempt.aborting`, then every touched server is resumed in
     resume order under this checkpoint id (phase `recovery`) — a server that already resumed
     replays its recorded result; a 409 `invalid_phase` means it never paused (`not_paused`); a
     server paused by *another* checkpoint id is reported and not touched; one whose every
     request the server refused before it ran (a wrong token, another id active) is `not_paused`
     without a call; a resume refused while an operation of this attempt ran there waits for it
     and is sent again (`resume.resume_members`) — then the staging folder is removed and
     `attempt.aborted` records who was resumed and who is left paused.
   - *restore*: its restore phase is finished first if it had not completed: the snapshot is
     verified again and the restore re-driven under the same restore id (servers that already
     restored replay their result; one still restoring is waited for). Gone or damaged (or the
     re-drive fails): the attempt is recorded as abandoned and the servers stay paused —
     half-restored state must not run. Restored: if its caller asked for a resume
     (`attempt.started {resume: true}`, `quiesce restore --resume`) or a resume of it had begun,
     the resume is a recorded step like any other and is finished — every participant resumed
     (phase `resume`), `attempt.completed {outcome: resumed}`; otherwise
     `attempt.completed {outcome: restored}` and the servers stay paused for the caller's resume.
3. **Record** one `recovery.settled` per settled server (what it reported, what was done, the
   result) once the action is done — before the attempt's terminal event when recovery writes it
   (abort, restore left paused); a resume phase writes its own `attempt.completed` first.
4. **Sweep** staging folders that belong to no unfinished attempt.

The run is framed by `recovery.started {attempts}` and `recovery.completed {outcomes}` (outcome
per attempt: `resumed` (a save aborted and resumed, or a restore finished and resumed),
`published`, `restored`, `abandoned`). On open, nothing is appended when no attempt is
unfinished; an explicit `recover()` always appends the frame, so a second `quiesce recover` makes
no call and appends only its start and finish.

Invariants: every call goes through `calls.Caller` with a budget of `control_timeout_s` from
the moment each step starts (a re-driven restore gets `deadline_s`); `FencedError` is never
caught (a fenced recovery stops acting); recovery never resumes a server for an attempt that
is not its own, and never resumes a half-restored server — a restore is resumed only once its
restore phase completed, and only when its caller asked for that resume.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Literal

import anyio
import anyio.to_thread

from quiesce.coordinator.attempt import (
    Attempt,
    Context,
    Resubmission,
    UnknownResubmissions,
    command_line,
    free_command,
    recover_hint,
    resume_sorted,
)
from quiesce.coordinator.discovery import Member
from quiesce.coordinator.errors import PhaseError
from quiesce.coordinator.protocol import MODEL, Capabilities
from quiesce.coordinator.protocol_v2 import StatusReply
from quiesce.coordinator.publish import (
    apply_retention,
    discard_staging,
    empty_trash,
    read_latest,
    sweep_staging,
    write_latest,
)
from quiesce.coordinator.readback import Recorded, settle_publication, unfinished
from quiesce.coordinator.restore import redrive, resubmissions_of, reverify
from quiesce.coordinator.restore_v2 import abandon, replacements
from quiesce.coordinator.resume import (
    finish_resume,
    next_step,
    operation_ended,
    operation_running,
    resume_members,
    still_running,
)

__all__ = ["AttemptReport", "RecoveryReport", "ServerReport", "recover"]

Action = Literal["resumed", "published", "restored", "abandoned", "none"]

#: The detail of an idle agent or resources participant resumed without a recorded request.
_UNRECORDED: Final = "no request of this attempt is recorded for it; resumed in case one was lost"


@dataclass(frozen=True)
class ServerReport:
    """One settled server: what its capabilities said and where recovery left it.

    `result`: `resumed`, `not_paused` (409 invalid_phase, or idle with no checkpoint id: it never
    paused), `restored` (left
    paused for the caller's resume), `left_paused` (a call failed; `detail` says why),
    `other_checkpoint` (paused by another checkpoint id, not touched), `unknown_server` (the
    config no longer names it).
    """

    name: str
    reported_phase: str | None
    active_checkpoint_id: str | None
    action: str
    result: str
    detail: str | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "reported_phase": self.reported_phase,
            "result": self.result,
        }
        if self.detail:
            out["detail"] = self.detail
        return out


@dataclass(frozen=True)
class AttemptReport:
    """What recovery found for one attempt and what it did. `message` says what to do next, if anything."""

    checkpoint_id: str
    kind: str
    found: str
    action: Action
    servers: tuple[ServerReport, ...] = ()
    message: str = ""
    #: a restore finished (restored or resumed): what the caller must send `/run` for again
    resubmit: tuple[Resubmission, ...] = ()
    #: a v1 restore finished: executions whose saved turn it discarded (their `/run` starts from
    #: the task), and agents whose resubmissions are unknown, with the reason
    restart: tuple[Resubmission, ...] = ()
    resubmit_unknown: tuple[UnknownResubmissions, ...] = ()

    @property
    def left_paused(self) -> list[str]:
        """Servers recovery could not bring back to accepting (restored ones are paused on purpose)."""
        return [s.name for s in self.servers if s.result in ("left_paused", "unknown_server")]

    def as_json(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "found": self.found,
            "action": self.action,
            "servers": [s.as_json() for s in self.servers],
            "message": self.message,
            **({"resubmit": [r.as_json() for r in self.resubmit]} if self.resubmit else {}),
            **({"restart": [r.as_json() for r in self.restart]} if self.restart else {}),
            **(
                {"resubmit_unknown": [u.as_json() for u in self.resubmit_unknown]}
                if self.resubmit_unknown
                else {}
            ),
        }


@dataclass(frozen=True)
class RecoveryReport:
    """One recovery run. `ok` is False when a server was left paused or an attempt was abandoned."""

    epoch: int
    attempts: tuple[AttemptReport, ...] = ()
    swept: tuple[str, ...] = ()
    recorded: bool = False

    @property
    def ok(self) -> bool:
        return all(a.action != "abandoned" and not a.left_paused for a in self.attempts)

    def as_json(self) -> dict[str, Any]:
        """The `quiesce recover --json` document."""
        return {
            "epoch": self.epoch,
            "attempts": [a.as_json() for a in self.attempts],
            "swept_staging": list(self.swept),
        }


@dataclass
class _Settled:
    member: Member | None
    name: str
    caps: Capabilities | None = None
    error: str | None = None
    result: str = ""
    detail: str | None = None
    action: str = "none"
    #: a unified-plane server's status (instead of capabilities)
    status: StatusReply | None = None

    @property
    def phase(self) -> str | None:
        if self.status is not None:
            return self.status.phase
        return self.caps.phase if self.caps else None

    @property
    def active(self) -> str | None:
        if self.status is not None:
            return self.status.checkpoint_id
        return self.caps.active_checkpoint_id if self.caps else None


@dataclass
class _Run:
    ctx: Context
    reports: list[AttemptReport] = field(default_factory=list)


async def recover(ctx: Context, *, always_record: bool = True) -> RecoveryReport:
    """Finish or roll back every attempt without a terminal event (see the module docstring).

    With `always_record=False` (on open) nothing is appended when there is nothing to recover.
    Raises `FencedError` if a newer coordinator took over meanwhile; nothing else is raised for
    a server that cannot be reached — it is reported as `left_paused`.
    """
    found = await unfinished(ctx.ledger, ctx.config)
    epoch = ctx.ledger.epoch
    if not found and not always_record:
        swept = await _sweep(ctx)
        return RecoveryReport(epoch, (), swept, recorded=False)
    ids = [recorded.attempt.checkpoint_id for recorded in found]
    await ctx.ledger.stage("recovery.started", data={"attempts": ids})
    reports: list[AttemptReport] = []
    for recorded in found:
        reports.append(await _recover_one(ctx, recorded))
    swept = await _sweep(ctx)
    await ctx.ledger.append(
        "recovery.completed", data={"outcomes": {r.checkpoint_id: r.action for r in reports}}
    )
    return RecoveryReport(epoch, tuple(reports), swept, recorded=True)


# ---------------------------------------------------------------------------------------------
# One attempt
# ---------------------------------------------------------------------------------------------


async def _recover_one(ctx: Context, recorded: Recorded) -> AttemptReport:
    attempt = recorded.attempt
    # what the dead coordinator was doing: the phase its projection row was in
    found = (
        "resume" if recorded.last_outcome == "restored" else recorded.row.state if recorded.row else "started"
    )
    if attempt.kind == "restore" and attempt.plane == "v2" and not recorded.restore_done:
        return await _clean_up_restore(ctx, recorded, found)
    if attempt.kind == "restore":
        report = await _recover_restore(ctx, recorded, found)
        if report.action not in ("restored", "resumed"):
            return report
        if attempt.plane == "v2":
            return replace(report, resubmit=replacements(attempt))
        return replace(
            report,
            resubmit=await resubmissions_of(ctx, attempt),
            restart=attempt.restart,
            resubmit_unknown=attempt.resubmit_unknown,
        )
    if await settle_publication(ctx, recorded):
        return await _finish_published(ctx, recorded, found)
    return await _abort(ctx, recorded, found)


def _budget(ctx: Context) -> float:
    return time.time() + ctx.config.control_timeout_s


async def _settle(ctx: Context, attempt: Attempt, names: list[str]) -> list[_Settled]:
    """Read the capabilities of `names` (resume order), waiting — until `max(deadline_ts, now) +
    control_timeout_s` — while an operation of this attempt still runs on one
    (`resume.operation_running`).

    With `fanout: parallel` the servers are read concurrently (reads change nothing; the result
    keeps resume order), so settling costs one round trip rather than one per server.
    """
    # past the attempt's deadline: an operation bound by it ends there, and is then seen ended
    budget = max(attempt.deadline_ts, time.time()) + ctx.config.control_timeout_s
    out: list[_Settled] = []

    async def settle(settled: _Settled, member: Member) -> None:
        if member.plane == "v2":  # no operation to wait for: a resume aborts whatever runs there
            read = await ctx.caller.v2_status(
                member.name,
                member.url,
                deadline_ts=budget,
                phase="recovery",
                checkpoint_id=attempt.checkpoint_id,
            )
            if read.ok and isinstance(read.reply, StatusReply):
                settled.status = read.reply
            else:
                settled.error = f"status: {read.describe()}"
            return
        result = await operation_ended(ctx, attempt, member, phase="recovery", deadline_ts=budget)
        if not result.ok or not isinstance(result.reply, Capabilities):
            settled.error = f"capabilities: {result.describe()}"
            return
        settled.caps = result.reply

    todo: list[tuple[_Settled, Member]] = []
    for name in resume_sorted(attempt, names):
        member = attempt.member(name)
        settled = _Settled(member, name)
        out.append(settled)
        if member is None:
            settled.error = "the config no longer names this server"
        else:
            todo.append((settled, member))
    if ctx.config.fanout == "parallel" and len(todo) > 1:
        async with anyio.create_task_group() as tg:
            for settled, member in todo:
                tg.start_soon(settle, settled, member)
    else:
        for settled, member in todo:
            await settle(settled, member)
    return out


async def _settle_touched(ctx: Context, attempt: Attempt, *, idle_may_be_touched: bool) -> list[_Settled]:
    """Settle the servers the attempt may have touched; those found so are added to `attempt.touched`.

    A server with a `call.sent` in the ledger was touched. A participant without one (its
    `call.sent` may have been lost with a power failure) counts as touched when it reports this
    checkpoint id as active — and, with `idle_may_be_touched` (rolling back a save), when it is an
    agent or resources server at `idle` with no active id: a prepare they refused (an agent's
    `agent_prepare_incomplete`) leaves their fence idle but their admission closed, and nothing
    in their capabilities tells it; a resume from idle is allowed and only retires this id. A
    model's pause always leaves the id active, so an idle model was not touched.
    """
    recorded = set(attempt.touched)
    unrecorded = [name for name in attempt.names if name not in recorded]
    settled = await _settle(ctx, attempt, list(attempt.touched) + unrecorded)
    out: list[_Settled] = []
    for s in settled:
        touched = s.name in recorded or s.active == attempt.checkpoint_id
        if not touched and idle_may_be_touched and s.member is not None and s.caps is not None:
            touched = s.member.component != MODEL and s.phase == "idle" and s.active is None
            if touched:
                s.detail = _UNRECORDED
        if touched:
            attempt.touch(s.name)
            out.append(s)
    return out


async def _record_settled(
    ctx: Context, attempt: Attempt, settled: list[_Settled]
) -> tuple[ServerReport, ...]:
    reports: list[ServerReport] = []
    for s in settled:
        await ctx.ledger.stage(
            "recovery.settled",
            checkpoint_id=attempt.checkpoint_id,
            server=s.name,
            data={
                "reported_phase": s.phase,
                "active_checkpoint_id": s.active,
                "action": s.action,
                "result": s.result if not s.detail else f"{s.result}: {s.detail}",
            },
        )
        reports.append(ServerReport(s.name, s.phase, s.active, s.action, s.result, s.detail or s.error))
    return tuple(reports)


async def _abort(ctx: Context, recorded: Recorded, found: str) -> AttemptReport:
    """Roll back a save before publication: resume every touched server of this attempt."""
    attempt = recorded.attempt
    cid = attempt.checkpoint_id
    settled = await _settle_touched(ctx, attempt, idle_may_be_touched=True)
    reason = f"recovered by epoch {ctx.ledger.epoch}: the coordinator died during {found}"
    await ctx.ledger.stage("attempt.aborting", checkpoint_id=cid, data={"reason": reason})
    to_resume: list[str] = []
    for s in settled:
        if s.member is None:
            s.result = "unknown_server"
        elif s.active not in (None, cid):
            s.result = "other_checkpoint"
            s.detail = f"paused by checkpoint {s.active}; not touched"
        elif s.name in attempt.refused and s.active is None:
            s.result = "not_paused"
            s.detail = f"it refused this attempt's request before running it ({attempt.refused[s.name]})"
        elif s.caps is not None and operation_running(s.caps, cid, s.member):
            s.result, s.detail = "left_paused", still_running(s.caps)  # a resume now would wedge or fail
        else:
            s.action = "resume"
            to_resume.append(s.name)
    _, resumed, not_paused, _, failures = await resume_members(
        ctx, attempt, to_resume, phase="recovery", deadline_ts=_budget(ctx)
    )
    _apply_resume_results(settled, resumed, not_paused, failures)
    if attempt.staging_dir is not None:
        await anyio.to_thread.run_sync(discard_staging, attempt.staging_dir, attempt.staging_roots)
    servers = await _record_settled(ctx, attempt, settled)
    # resume failures and servers still running an operation of this attempt are left paused
    left_all = [s.name for s in settled if s.result in ("unknown_server", "left_paused")]
    await ctx.ledger.append(
        "attempt.aborted",
        checkpoint_id=cid,
        data={"reason": reason, "resumed": resumed, "left_paused": left_all, "not_paused": not_paused},
    )
    latest = read_latest(ctx.config.snapshots)
    message = f"rolled back; latest snapshot: {latest if latest else 'none'}."
    if left_all:
        message += (
            f" Could not resume {', '.join(left_all)}: run"
            f" `{free_command(ctx, 'resume', cid)}` once they are reachable (or their operation has"
            " ended); the rollback is recorded, so `quiesce recover` does not retry it."
        )
    return AttemptReport(cid, attempt.kind, found, "resumed", servers, message)


def _apply_resume_results(
    settled: list[_Settled],
    resumed: list[str],
    not_paused: list[str],
    failures: list[tuple[str, Any]],
    *,
    every: bool = False,
) -> None:
    failed = {name: result.describe() for name, result in failures}
    for s in settled:
        if s.action != "resume" and not every:
            continue
        if s.name in resumed:
            s.result = "resumed"
        elif s.name in not_paused:
            s.result = "not_paused"
        else:
            s.result = "left_paused"
            s.detail = failed.get(s.name, "no time left to call it")


async def _finish_published(ctx: Context, recorded: Recorded, found: str) -> AttemptReport:
    """A save that really was published: LATEST, retention, then resume every participant."""
    attempt = recorded.attempt
    final = attempt.snapshot
    assert final is not None
    snapshots = ctx.config.snapshots
    latest = read_latest(snapshots)
    if latest is None or latest.resolve() != final.resolve():
        await anyio.to_thread.run_sync(write_latest, final.parent, final.name)
    await anyio.to_thread.run_sync(
        lambda: apply_retention(snapshots, ctx.config.keep_latest, protect=[final])
    )
    settled = await _settle(ctx, attempt, attempt.names)
    if attempt.stop:  # a stop-checkpoint: published, its servers stay paused for shutdown
        return await _stopped(ctx, recorded, settled, found)
    for s in settled:
        s.action = "resume"
    try:
        outcome = await finish_resume(ctx, attempt)
        _apply_resume_results(settled, list(outcome.resumed), list(outcome.not_paused), [])
    except PhaseError as error:  # some server could not be resumed: the attempt stays open, retried later
        for s in settled:
            if s.name in error.not_resumed:
                s.result, s.detail = "left_paused", error.reason
            else:
                s.result = "resumed"
    servers = await _record_settled(ctx, attempt, settled)
    left = [s.name for s in servers if s.result == "left_paused"]
    message = f"published {final}."
    if left:
        message += (
            f" Could not resume {', '.join(left)}: run {recover_hint(ctx, attempt.checkpoint_id)} once they"
            " are reachable."
        )
    return AttemptReport(attempt.checkpoint_id, attempt.kind, found, "published", servers, message)


async def _stopped(ctx: Context, recorded: Recorded, settled: list[_Settled], found: str) -> AttemptReport:
    """A published stop-checkpoint (unified plane): nothing is resumed — its servers were paused for
    shutdown on purpose; `attempt.completed {published}` ends it."""
    attempt = recorded.attempt
    for s in settled:
        s.result = "stopped"
    servers = await _record_settled(ctx, attempt, settled)
    await ctx.ledger.append(
        "attempt.completed", checkpoint_id=attempt.checkpoint_id, data={"servers": [], "outcome": "published"}
    )
    message = (
        f"published {attempt.snapshot} as a stop-checkpoint; its servers stay paused for shutdown"
        " (restore it into freshly started servers to go on)."
    )
    return AttemptReport(attempt.checkpoint_id, attempt.kind, found, "published", servers, message)


async def _clean_up_restore(ctx: Context, recorded: Recorded, found: str) -> AttemptReport:
    """An interrupted unified-plane restore: never finished half-way — the next attempts of its
    inventory are retired everywhere and everyone is resumed (`restore_v2.abandon`)."""
    attempt = recorded.attempt
    settled = await _settle(ctx, attempt, attempt.names)
    error = await abandon(
        ctx, attempt, f"recovered by epoch {ctx.ledger.epoch}: the coordinator died during {found}"
    )
    for s in settled:
        s.action = "retire, resume"
        s.result = "resumed" if s.name in error.resumed else "left_paused"
        if s.result == "left_paused":
            s.detail = error.reason
    servers = await _record_settled(ctx, attempt, settled)
    message = (
        f"restore {attempt.checkpoint_id} had not finished: its next attempts were retired everywhere"
        " and everyone resumed — nothing restored runs. Restart the servers fresh and restore again."
    )
    return AttemptReport(attempt.checkpoint_id, attempt.kind, found, "resumed", servers, message)


async def _recover_restore(ctx: Context, recorded: Recorded, found: str) -> AttemptReport:
    """Finish an interrupted restore from its snapshot (unless its restore phase completed), then
    resume it if its caller asked for that or had begun it; otherwise leave it paused, restored.
    A restore that cannot be finished is abandoned (paused)."""
    attempt = recorded.attempt
    cid = attempt.checkpoint_id
    settled = await _settle_touched(ctx, attempt, idle_may_be_touched=False)
    if not recorded.restore_done:
        snapshot = await reverify(ctx, attempt)
        if isinstance(snapshot, str):
            return await _abandon(ctx, attempt, settled, found, snapshot)
        for s in settled:
            s.action = "restore"
        problem = await redrive(ctx, attempt, snapshot)
        if problem is not None:
            return await _abandon(ctx, attempt, settled, found, problem)
        by_name = {s.name: s for s in settled}
        for name in attempt.touched:
            if name not in by_name:  # restored now, untouched before the crash
                by_name[name] = _Settled(attempt.member(name), name, action="restore")
                settled.append(by_name[name])
    if recorded.resume_wanted or recorded.resume_begun:
        return await _resume_restored(ctx, recorded, settled, found)
    for s in settled:
        s.result = "restored"
    servers = await _record_settled(ctx, attempt, settled)
    await ctx.ledger.append(
        "attempt.completed", checkpoint_id=cid, data={"servers": list(attempt.touched), "outcome": "restored"}
    )
    message = (
        f"restore of {attempt.snapshot} finished as {cid}; the servers stay paused until"
        f" `{free_command(ctx, 'resume', cid)}` ({', '.join(attempt.touched)})."
    )
    return AttemptReport(cid, attempt.kind, found, "restored", servers, message)


async def _resume_restored(
    ctx: Context, recorded: Recorded, settled: list[_Settled], found: str
) -> AttemptReport:
    """The resume a restore's caller asked for (or had begun): every participant, phase resume."""
    attempt = recorded.attempt
    cid = attempt.checkpoint_id
    by_name = {s.name: s for s in settled}
    for name in attempt.names:
        if name not in by_name:
            by_name[name] = _Settled(attempt.member(name), name)
            settled.append(by_name[name])
    for s in settled:
        s.action = "restore, resume" if s.action == "restore" else "resume"
    try:
        outcome = await finish_resume(ctx, attempt)
        _apply_resume_results(settled, list(outcome.resumed), list(outcome.not_paused), [], every=True)
        for s in settled:
            if s.name in outcome.restored_again:
                s.action = "restore, resume"
                s.detail = "restarted since the restore: restored again before the resume"
    except PhaseError as error:  # a server could not be resumed: the attempt stays open, retried later
        for s in settled:
            s.result, s.detail = (
                ("left_paused", error.reason) if s.name in error.not_resumed else ("resumed", None)
            )
    servers = await _record_settled(ctx, attempt, settled)
    left = [s.name for s in servers if s.result == "left_paused"]
    message = f"restore of {attempt.snapshot} finished as {cid} and resumed, as its caller asked."
    if left:
        message += f" Could not resume {', '.join(left)}: " + next_step(ctx, cid, [])
    return AttemptReport(cid, attempt.kind, found, "resumed", servers, message)


async def _abandon(
    ctx: Context, attempt: Attempt, settled: list[_Settled], found: str, why: str
) -> AttemptReport:
    for s in settled:
        if s.phase == "idle" and s.active is None:  # its restore never reached it, or it refused it
            s.action, s.result = "none", "not_paused"
            s.detail = (
                "its fence shows no trace of the restore (never received, or refused before it ran):"
                " nothing of the snapshot was installed there; a resources server that refused it may"
                " still have closed its admission — `quiesce status` shows it,"
                f" `{command_line(ctx.config_path, 'resume', service=ctx.service)}` reopens it"
            )
        else:
            s.action, s.result = "none", "left_paused"
            s.detail = "half-restored state must not run"
    servers = await _record_settled(ctx, attempt, settled)
    paused = [s.name for s in settled if s.result == "left_paused"]
    message = (
        f"restore {attempt.checkpoint_id} was abandoned: {why}. The servers it touched stay paused"
        f" (half-restored state must not run): {', '.join(paused) or 'none'}. To proceed, restart those"
        " servers and restore another snapshot"
        f" (`{command_line(ctx.config_path, 'restore', '--snapshot', 'DIR', service=ctx.service)}`), or run"
        f" `{free_command(ctx, 'resume', attempt.checkpoint_id)}` to run them as they are."
    )
    return AttemptReport(attempt.checkpoint_id, attempt.kind, found, "abandoned", servers, message)


async def _sweep(ctx: Context) -> tuple[str, ...]:
    """Remove every staging folder that belongs to no unfinished attempt, and empty the trash
    (snapshots retention removed but a dead coordinator had not deleted yet)."""
    await anyio.to_thread.run_sync(empty_trash, ctx.config.snapshots)
    root = ctx.config.staging_root
    if not await anyio.to_thread.run_sync(root.is_dir):
        return ()
    open_ids = {row.checkpoint_id for row in await ctx.ledger.unfinished_attempts()}

    def names() -> list[str]:
        return [p.name for p in Path(root).iterdir() if p.is_dir() and p.name not in open_ids]

    doomed = await anyio.to_thread.run_sync(names)
    removed = await anyio.to_thread.run_sync(sweep_staging, root, doomed)
    return tuple(p.name for p in removed)
