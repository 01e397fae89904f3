"""Resume and rollback: the only ways a paused server is let go.

- `resume_members` resumes the given servers in resume order (resources → policy → agents, fan-out
  within a role group) and never stops early. A resume is never sent while an operation of this
  attempt still runs on the server (`operation_running`: its fence in an operation's phase with
  this checkpoint id active, read from its capabilities — for the servers named in
  `check_first`, and after every 409 `invalid_phase`): it waits for that operation to end
  (within the budget), then resumes; one still running when the budget ends is left paused,
  saying so. 409 `invalid_phase` from a server whose fence shows no operation of this attempt
  means it never paused.
- `roll_back` (a save before publication) resumes every *touched* server — its request was sent,
  answered or not — removes the staging folder, and records `attempt.aborting` … `attempt.aborted
  {resumed, left_paused, not_paused}`. Each role group's budget is `max(deadline_ts, now +
  control_timeout_s)` from when it starts.
- `finish_resume` resumes every participant of a published save or of a restore; a server that
  cannot be resumed leaves the attempt without a terminal event, so the same id's resume can be
  retried (by the caller or by recovery).
- `rolled_back_on_failure` wraps a save step: any failure, cancellation included, is rolled back
  (shielded) before it propagates. `FencedError` is never handled: a fenced coordinator stops. A
  ledger that cannot be written (a full disk) makes the rollback impossible — its resumes could not
  be recorded first — and raises `stranded.LedgerStranded`, naming who may be left paused and
  `quiesce recover`; so does `finish_resume`.
"""

import dataclasses
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from typing import Final, Literal

import anyio
import anyio.to_thread

from quiesce.coordinator.attempt import (
    Attempt,
    Context,
    Outcome,
    PhaseFailure,
    Progress,
    anyio_deadline,
    free_command,
    plain_body,
    record_phase_failed,
    recovery_budget,
    send_call,
)
from quiesce.coordinator.calls import Body, CallResult, encode_body
from quiesce.coordinator.discovery import Member
from quiesce.coordinator.errors import DeadlineExceeded, FencedError, LedgerError, PhaseError
from quiesce.coordinator.phases import resume_order
from quiesce.coordinator.protocol import (
    INVALID_PHASE,
    RESOURCES,
    Capabilities,
)
from quiesce.coordinator.protocol_v2 import CHECKPOINT_CONFLICT
from quiesce.coordinator.publish import (
    discard_staging,
    read_latest,
)
from quiesce.coordinator.restore import reinstate
from quiesce.coordinator.stranded import stranded


async def rolled_back_on_failure(
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
        try:
            error = await roll_back(ctx, attempt, failure)
        except FencedError:
            raise
        except LedgerError as lost:  # the ledger stopped taking writes: nothing more can be sent
            raise stranded(ctx, attempt, lost) from None
        raise error from None
    except FencedError:
        raise
    except BaseException as exc:
        interrupted = PhaseFailure(phase, attempt.last_server, f"interrupted by {type(exc).__name__}: {exc}")
        with anyio.CancelScope(shield=True):
            try:
                error = await roll_back(ctx, attempt, interrupted)
            except FencedError:
                raise
            except LedgerError as lost:
                if isinstance(exc, LedgerError):  # e.g. a full disk: the rollback could not be recorded
                    raise stranded(ctx, attempt, exc) from None
                exc.add_note(str(stranded(ctx, attempt, lost)))
                raise exc from None
        exc.add_note(str(error))
        raise


# ---------------------------------------------------------------------------------------------
# Resume and rollback
# ---------------------------------------------------------------------------------------------


#: Fence phases in which an operation may still run on the server (Gym's
#: `ControlFence`): a resume there is refused (409 `invalid_phase`), and counting that refusal as
#: "never paused" would leave the server paused for good once the operation ends. A resources
#: server's `preparing` is one too (its resume is refused there). A policy model's or an agent's
#: `preparing` is not: the model stays `preparing` while it drains, with no operation running, and
#: an agent's prepare, once resumed, sets its parked executions running again, so it cannot become
#: ready and ends as a failure that leaves the fence idle — both are resumed at once.
IN_FLIGHT_PHASES: Final = frozenset({"committing", "restoring"})
IN_FLIGHT_FOR_RESOURCES: Final = frozenset({"preparing"})
#: First and longest pause between two reads of a server whose operation is still running.
_POLL_FIRST_S: Final = 0.05
_POLL_MAX_S: Final = 1.0
#: How many times one server's resume is sent when each was refused while an operation of this
#: attempt ran there, and that operation ended before the next.
_RESUME_TRIES: Final = 3


def operation_running(caps: Capabilities, checkpoint_id: str, member: Member) -> bool:
    """Whether `caps` (of `member`) shows an operation of `checkpoint_id` still running there."""
    if caps.active_checkpoint_id != checkpoint_id:
        return False
    if caps.phase in IN_FLIGHT_FOR_RESOURCES:
        return member.component == RESOURCES
    return caps.phase in IN_FLIGHT_PHASES


async def operation_ended(
    ctx: Context, attempt: Attempt, member: Member, *, phase: str, deadline_ts: float
) -> CallResult:
    """Read `member`'s capabilities (recorded, phase `phase`) until no operation of this attempt
    runs there or `deadline_ts` is near; the last read (a failed one ends the wait)."""
    pause = _POLL_FIRST_S
    while True:
        result = await ctx.caller.capabilities(
            member.name, member.url, deadline_ts=deadline_ts, phase=phase, checkpoint_id=attempt.checkpoint_id
        )
        caps = result.reply
        if (
            not result.ok
            or not isinstance(caps, Capabilities)
            or not operation_running(caps, attempt.checkpoint_id, member)
            or time.time() + pause >= deadline_ts
        ):
            return result
        await anyio.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


def still_running(caps: Capabilities) -> str:
    """Why a server whose operation of this attempt outlasted the budget was not resumed."""
    return (
        f"its {caps.phase} of this checkpoint was still running when the budget ended (a resume must"
        " wait for it to end); it stays paused — resume it once that operation has finished"
    )


def _still_running(result: CallResult, caps: Capabilities) -> CallResult:
    """`result` (a refused resume) described as what it is: the server's operation outlasted the budget."""
    return dataclasses.replace(result, detail=still_running(caps))


async def resume_members(
    ctx: Context,
    attempt: Attempt,
    names: Sequence[str],
    *,
    phase: str,
    deadline_ts: float,
    check_first: Collection[str] = (),
) -> tuple[list[str], list[str], list[str], list[str], list[tuple[str, CallResult]]]:
    """Resume `names` in resume order (fan-out within a group). Never stops early.

    Each role group has the budget `max(deadline_ts, now + control_timeout_s)` from when it starts.
    The servers in `check_first` (an operation of this attempt may still run there: its request
    got no reply) are read first and waited for; so is any server that refuses the resume with
    409 `invalid_phase` (see the module docstring).

    Returns (called in order, resumed, not_paused, left_paused, failures).
    """
    wanted = set(names)
    ctx.progress(
        Progress(attempt.checkpoint_id, phase, step="phase", servers=len(wanted), deadline_ts=deadline_ts)
    )
    called: list[str] = []
    resumed: list[str] = []
    not_paused: list[str] = []
    failures: list[tuple[str, CallResult]] = []

    async def one(m: Member, deadline_ts: float, body: Body) -> None:
        called.append(m.name)
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        if m.plane == "v2":
            await one_v2(m, deadline_ts, body)
            return
        if m.name in check_first:
            await operation_ended(ctx, attempt, m, phase=phase, deadline_ts=deadline_ts)
        for _ in range(_RESUME_TRIES):
            result = await send_call(ctx, attempt, m, "resume", phase, body=body, deadline_ts=deadline_ts)
            if result.ok:
                resumed.append(m.name)
                attempt.resumed.add(m.name)
                return
            if not (result.error == "http" and result.status == 409 and result.code == INVALID_PHASE):
                failures.append((m.name, result))
                return
            read = await operation_ended(ctx, attempt, m, phase=phase, deadline_ts=deadline_ts)
            caps = read.reply if read.ok else None
            if not isinstance(caps, Capabilities) or caps.active_checkpoint_id != attempt.checkpoint_id:
                not_paused.append(m.name)  # its fence holds nothing of this attempt: it never paused
                return
            if operation_running(caps, attempt.checkpoint_id, m):
                failures.append((m.name, _still_running(result, caps)))
                return
            # the operation ended meanwhile and left this checkpoint paused there: resume again
        failures.append((m.name, result))

    async def one_v2(m: Member, deadline_ts: float, body: Body) -> None:
        # the unified plane's resume is legal in every phase and aborts whatever runs there (the
        # writer is stopped first: no manifest is published after it), so nothing is waited for;
        # `checkpoint_conflict`: another id holds the server — this attempt holds nothing there
        result = await send_call(ctx, attempt, m, "resume", phase, body=body, deadline_ts=deadline_ts)
        if result.ok:
            resumed.append(m.name)
            attempt.resumed.add(m.name)
        elif result.error == "http" and result.status == 409 and result.code == CHECKPOINT_CONFLICT:
            not_paused.append(m.name)
        else:
            failures.append((m.name, result))

    for role in resume_order(attempt.plane):
        members = [m for m in attempt.group(role) if m.name in wanted]
        if not members:
            continue
        # each group its own budget: a slow group (a multi-worker model acknowledging its workers)
        # does not use up the time of the groups after it
        group_deadline = max(deadline_ts, time.time() + ctx.config.control_timeout_s)
        # the group's resume body, built and encoded once per plane (a cluster speaks one)
        bodies: dict[str, Body] = {}
        for m in members:
            if m.plane not in bodies:
                bodies[m.plane] = encode_body(plain_body(m, attempt.checkpoint_id, group_deadline))
        with anyio.CancelScope(deadline=anyio_deadline(group_deadline)):
            if ctx.config.fanout == "parallel" and len(members) > 1:
                async with anyio.create_task_group() as tg:
                    for m in members:
                        tg.start_soon(one, m, group_deadline, bodies[m.plane])
            else:
                for m in members:
                    await one(m, group_deadline, bodies[m.plane])
    # whoever is neither resumed nor known never-paused is left paused: a failed call, the budget
    # running out before (or during) its call, or a server the config no longer names
    settled = set(resumed) | set(not_paused)
    left = [n for n in names if n not in settled]
    if left:
        ctx.progress(
            Progress(attempt.checkpoint_id, phase, step="failed", error=f"not resumed: {', '.join(left)}")
        )
    else:
        ctx.progress(Progress(attempt.checkpoint_id, phase, step="done"))
    return called, resumed, not_paused, left, failures


#: What to do when a server refused the control token (401): the resume cannot work until it is fixed.
TOKEN_HINT: Final = (
    "A 401 means the server refused the control token: set {env} to the Gym servers' control token."
)


def _token_refused(described: Iterable[str]) -> bool:
    return any(text.startswith("http 401") for text in described)


def next_step(ctx: Context, checkpoint_id: str, failures: Sequence[CallResult]) -> str:
    """What to run once the cause of `failures` (failed resumes) is fixed: the token, or reaching them."""
    command = free_command(ctx, "resume", checkpoint_id)
    if any(r.status == 401 for r in failures):
        return f"{TOKEN_HINT.format(env=ctx.config.token_env)} Then run `{command}`."
    return f"Run `{command}` once they are reachable."


async def roll_back(
    ctx: Context, attempt: Attempt, failure: PhaseFailure | None, *, reason: str | None = None
) -> PhaseError:
    """Resume every server the attempt may have paused (resume order), remove staging, record;
    return the error to raise.

    Save attempts only (a failed restore is recorded by `restore` and left paused). Every touched
    server is resumed — once no operation of this attempt runs there (`resume_members`) — but
    those whose every request was refused before it ran
    (`Attempt.refused`: a wrong token, another checkpoint id holding it): this attempt paused
    nothing there, so they are recorded as `not_paused` without a call. The budget is
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
    budget = recovery_budget(ctx, attempt)
    may_hold = attempt.may_hold
    _, resumed, not_paused, left, failures = await resume_members(
        ctx,
        attempt,
        may_hold,
        phase="rollback",
        deadline_ts=budget,
        check_first=[name for name in may_hold if name in attempt.unanswered],
    )
    refused = dict(attempt.refused)
    never = [name for name in attempt.touched if name in refused]
    if attempt.staging_dir is not None:
        await anyio.to_thread.run_sync(discard_staging, attempt.staging_dir, attempt.staging_roots)
    await ctx.ledger.append(
        "attempt.aborted",
        checkpoint_id=attempt.checkpoint_id,
        data={"reason": text, "resumed": resumed, "left_paused": left, "not_paused": not_paused + never},
    )
    attempt.state = "aborted"
    latest = read_latest(ctx.config.snapshots)
    phase = failure.phase if failure else "abort"
    refusals = ", ".join(f"{n} (it refused the request: {refused[n]})" for n in never)
    message = (
        f"checkpoint {attempt.checkpoint_id} rolled back: {text}."
        f" Resumed (their resume answered accepting): {', '.join(resumed) or 'none'}."
        + (f" Never paused: {refusals}." if never else "")
        + _unconfirmed(
            not_paused, left, failures, next_step(ctx, attempt.checkpoint_id, [r for _, r in failures])
        )
        + (f" {TOKEN_HINT.format(env=ctx.config.token_env)}" if _token_refused(refused.values()) else "")
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
        resumed=resumed + not_paused + never,
        not_resumed=left,
        latest_snapshot=str(latest) if latest else None,
    )


def _unconfirmed(
    not_paused: Sequence[str], left: Sequence[str], failures: Sequence[tuple[str, CallResult]], advice: str
) -> str:
    """What a rollback message says beyond the servers whose resume replied `accepting`: only when
    every touched server did does it say every server is accepting again (untouched ones were
    never sent anything); otherwise it names each server whose state the replies did not show."""
    text = ""
    if not_paused:
        text += (
            f" Not confirmed accepting: {', '.join(not_paused)} — its resume found the fence idle"
            " (409 invalid_phase), but a pause that failed may still have closed its admission; check"
            " it with `quiesce status`."
        )
    if left:
        why = dict((name, result.describe()) for name, result in failures)
        named = ", ".join(f"{name} ({why[name]})" if name in why else name for name in left)
        text += f" Could not resume: {named} — {advice}"
    if not text:
        text = " Every server is accepting again."
    return text


async def finish_resume(ctx: Context, attempt: Attempt) -> Outcome:
    """Resume every participant of a published save, or of a restore; then `attempt.completed`.

    Servers that cannot be resumed leave the attempt without a terminal event (so the same id's
    resume can be retried) and raise `PhaseError` naming them. A restore's participants that
    restarted since it are restored again first (`restore.reinstate`), or nobody is resumed.
    """
    try:
        await ctx.ledger.stage("phase.started", checkpoint_id=attempt.checkpoint_id, data={"phase": "resume"})
        if attempt.kind == "restore" and attempt.plane == "v1":  # a death here leaves it to recovery
            await reinstate(ctx, attempt)
        budget = recovery_budget(ctx, attempt)
        called, resumed, not_paused, left, failures = await resume_members(
            ctx, attempt, attempt.names, phase="resume", deadline_ts=budget
        )
    except FencedError:
        raise
    except LedgerError as lost:
        raise stranded(ctx, attempt, lost) from None
    if left:
        name = left[0]
        detail = next((r.describe() for n, r in failures if n == name), "no time left to call it")
        code = next((r.code for n, r in failures if n == name), None)
        await record_phase_failed(ctx, attempt.checkpoint_id, "resume", name, detail, code)
        latest = read_latest(ctx.config.snapshots)
        raise PhaseError(
            f"resume of {attempt.checkpoint_id} failed at {name}: {detail}."
            f" Resumed: {', '.join(resumed) or 'none'}; still paused: {', '.join(left)}. "
            + next_step(ctx, attempt.checkpoint_id, [r for _, r in failures])
            + f" Latest snapshot: {latest if latest else 'none'}.",
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
    return Outcome(
        attempt.checkpoint_id,
        outcome,
        tuple(called),
        tuple(resumed),
        tuple(not_paused),
        (),
        restored_again=attempt.restored_again,
        plane=attempt.plane,
    )


async def release_unrecorded(ctx: Context, checkpoint_id: str, members: Sequence[Member]) -> Outcome:
    """Resume `members` (servers that report `checkpoint_id` active) under an id this ledger has no
    attempt of — another ledger's, or one whose records were lost — in resume order.

    Only on an explicit request (`quiesce resume`, which asks the servers first): no record says
    what that attempt did, so nothing but the resume is done; its calls are recorded under that
    id (a ledger that never started it judges nothing of it). Raises `PhaseError` naming those
    still paused.
    """
    attempt = Attempt(
        checkpoint_id=checkpoint_id,
        kind="save",
        deadline_ts=time.time() + ctx.config.control_timeout_s,
        participants=tuple(members),
    )
    await ctx.ledger.stage("phase.started", checkpoint_id=checkpoint_id, data={"phase": "resume"})
    called, resumed, not_paused, left, failures = await resume_members(
        ctx, attempt, [m.name for m in members], phase="resume", deadline_ts=attempt.deadline_ts
    )
    if left:
        name = left[0]
        detail = next((r.describe() for n, r in failures if n == name), "no time left to call it")
        await record_phase_failed(ctx, checkpoint_id, "resume", name, detail, None)
        raise PhaseError(
            f"resume of {checkpoint_id} (not an attempt of this ledger) failed at {name}: {detail}."
            f" Still paused: {', '.join(left)}. " + next_step(ctx, checkpoint_id, [r for _, r in failures]),
            phase="resume",
            server=name,
            reason=detail,
            checkpoint_id=checkpoint_id,
            resumed=resumed + not_paused,
            not_resumed=left,
        )
    await ctx.ledger.append(
        "phase.completed",
        checkpoint_id=checkpoint_id,
        data={"phase": "resume", "summary": {"resumed": resumed, "not_paused": not_paused}},
    )
    return Outcome(checkpoint_id, "resumed", tuple(called), tuple(resumed), tuple(not_paused), ())
