"""A save: start → prepare → commit → publish (the resume is `resume.py`'s), in Gym's control plane v1 order.

- prepare: policy pause → agents prepare (`agent_prepare_incomplete` retried every
  `AGENT_RETRY_S` until the deadline) → resources prepare → policy status long-poll until drained.
  Drained is read from the status reply itself (`ModelStatusReply.not_drained`): `paused`,
  nothing in flight, every worker there and acknowledged — the single-worker and the
  multi-worker coordinator shapes alike. A status reply naming another checkpoint id is a failed
  call. A model that paused by a generation cut (later Gym with a generation-cut backend: calls
  cut, their responses held until resume) never drains: the prepare fails at once, saying why.
  An agent refused only because it holds finished results nobody acknowledged — nothing else in
  flight there, by its refusal and its status — fails the prepare at once, one failed call, naming
  those executions and the command and API call that acknowledge them (no retry could succeed
  before they are). While other work may still park, it is retried; its held results are read
  again only when its refusal's counts change, and named if the deadline ends the wait — also when
  the deadline cuts a retry, a status read or the pause between them short (`Attempt.waiting_on`).
- commit: agents → policy (given the continuation indexes of the agents of its own folder) →
  resources; each server's `checkpoint_dir` is its folder of the staging folder (`Member.folder`;
  the folders are made first), where it writes under the name it reports (`Member.gym_name`).
  Each commit record names its folder, its manifest by its path in the snapshot (the folder
  first), and its artifact references as the server gave them (relative to its folder, and
  checked there). Each role group's manifest digests and artifact references are verified
  before the next group is called. Each agent's continuation index (`continuations.jsonl`) is
  read once for that: its bytes, sha256 and record count must be the reply's reference and every
  record a continuation row — else the commit fails at that agent, before the model is called.
  A drain-only policy model
  (`checkpoint_mode: stateless`) is not committed. The model's `storage_reference_index` is
  verified like every artifact and kept in the attempt's commit record (so in the snapshot
  manifest) and in the commit phase's summary. Once every group is verified, `rollouts.captured`
  records per agent the `(rollout_id, attempt)` of each of its continuation rows (an agent with
  none: an empty list); it is staged just before the commit's `phase.completed`, so it is
  committed no later than that record — a ledger that shows the commit completed shows what it
  captured (the snapshot's rename waits for neither: see `attempt.py`).
- publish: every staged file hashed and fsynced, the manifest written last, then the rename of
  `<snapshots>/.staging/<id>` to `<snapshots>/<id>` (`final_dir_of`) — the commit point — then
  `LATEST` and retention.

Any failure before the rename rolls back (`resume.rolled_back_on_failure`) and raises; after it,
the snapshot is published whatever happens next. Durability of each record: see `attempt.py`.
"""

import hashlib
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final

import anyio
import anyio.to_thread
from pydantic import BaseModel, ValidationError

from quiesce.coordinator.attempt import (
    Attempt,
    Context,
    PhaseFailure,
    Progress,
    command_line,
    common_body,
    each_member,
    expect_reply,
    next_checkpoint_id,
    require_state,
    run_phase,
    send_call,
)
from quiesce.coordinator.calls import CallResult
from quiesce.coordinator.digests import DigestCache, regular_bytes, regular_facts
from quiesce.coordinator.discovery import Discovery, Member
from quiesce.coordinator.errors import SnapshotError
from quiesce.coordinator.preflight import remember_snapshot_bytes
from quiesce.coordinator.protocol import (
    AGENT_PREPARE_INCOMPLETE as _AGENT_PREPARE_INCOMPLETE,
)
from quiesce.coordinator.protocol import (
    MISSING_WORKERS,
    AgentCommitReply,
    AgentPrepareReply,
    AgentStatusReply,
    ArtifactRef,
    CheckpointDirBody,
    ContinuationRow,
    ModelCommitBody,
    ModelCommitReply,
    ModelPauseReply,
    ModelStatusReply,
    ResourcesCommitReply,
    ResourcesPrepareReply,
    StatusQuery,
    Workers,
    manifest_path,
)
from quiesce.coordinator.publish import (
    IN_PLACE_MANIFEST,
    MANIFEST,
    apply_retention,
    build_manifest,
    fsync_dir,
    rename_into_place,
    staging_problem,
    sweep_staging,
    tree_digests,
    unpublishable,
    verify_artifact,
    write_json_durably,
    write_latest,
)
from quiesce.coordinator.restore import continuation_rows
from quiesce.coordinator.resume import rolled_back_on_failure
from quiesce.coordinator.staging import beside_prepare, made_for_commit
from quiesce.coordinator.wording import count
from quiesce.ledger import utc_now

#: Longest single status long-poll while draining (so progress is reported at least this often).
DRAIN_POLL_S: Final = 1.0
#: The long-poll's own timeout stays this far below the time left, so its reply beats the deadline.
POLL_MARGIN_S: Final = 0.2
#: How often `agent_prepare_incomplete` is retried (at most).
AGENT_RETRY_S: Final = 0.1
#: An agent refusal whose counts cannot be read has its status read again at most this often.
HELD_READ_S: Final = 1.0
#: At most this many unacknowledged executions are named in an error (the rest are counted).
NAMED_EXECUTIONS: Final = 20
#: One count of Gym's `agent_prepare_incomplete` detail
#: (`running=R, parked_without_boundary=P, completed_unacknowledged=C`).
_COUNT: Final = re.compile(r"\b(running|parked_without_boundary|completed_unacknowledged)=(\d+)")


# ---------------------------------------------------------------------------------------------
# Save: start, prepare, commit, publish
# ---------------------------------------------------------------------------------------------


async def start_attempt(
    ctx: Context,
    discovery: Discovery,
    *,
    deadline_s: float | None = None,
    warnings: Sequence[str] = (),
    stop: bool = False,
    into: Path | None = None,
    in_place: bool = False,
) -> Attempt:
    """Append `attempt.started` for a new save attempt and return it (nothing is called yet).

    `warnings` (the preflight's) are recorded in it and kept on the attempt; so are the plane of
    the cluster and, on the unified plane, `stop` (a stop-checkpoint: its servers stay paused)
    and `into` (committed into that folder and published there in place: `in_place`).
    `in_place` without `into`: published in place into a folder the commit names
    (`save_v2.commit(into=...)`); until then the attempt has no staging folder."""
    checkpoint_id = await next_checkpoint_id(ctx.ledger)
    deadline_ts = time.time() + (deadline_s if deadline_s is not None else ctx.config.deadline_s)
    in_place = in_place or into is not None
    staging = into if into is not None else None if in_place else ctx.config.staging_root / checkpoint_id
    attempt = Attempt(
        checkpoint_id=checkpoint_id,
        kind="save",
        deadline_ts=deadline_ts,
        participants=discovery.participants,
        staging_dir=staging,
        skipped=[{"name": n, "reason": r} for n, r in discovery.skipped],
        warnings=list(warnings),
        stop=stop,
        in_place=in_place,
    )
    await ctx.ledger.stage(
        "attempt.started",
        checkpoint_id=checkpoint_id,
        data={
            **({"plane": "v2"} if discovery.plane == "v2" else {}),
            **({"stop": True} if stop else {}),
            **({"in_place": True} if in_place else {}),
            "kind": "save",
            "deadline_ts": deadline_ts,
            "participants": attempt.names,
            **({"staging_dir": str(staging)} if staging is not None else {}),
            **({"warnings": list(warnings)} if warnings else {}),
        },
        durable=True,  # see "Durability" in the module docstring
    )
    return attempt


async def prepare(ctx: Context, attempt: Attempt) -> None:
    """Prepare: policy pause → agents prepare → resources prepare → policy drain. Rolls back on failure."""
    require_state(attempt, ("started",), "prepare")

    async def body() -> None:
        await run_phase(
            ctx, attempt, "prepare", lambda: beside_prepare(attempt, lambda: _prepare_body(ctx, attempt))
        )

    await rolled_back_on_failure(ctx, attempt, "prepare", body)
    attempt.state = "prepared"


async def _prepare_body(ctx: Context, attempt: Attempt) -> dict[str, Any]:
    phase = "prepare"

    async def pause(m: Member) -> ModelPauseReply:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        result = await send_call(ctx, attempt, m, "pause", phase, body=common_body(attempt))
        if result.error == "http" and result.status == 409 and result.code == MISSING_WORKERS:
            raise PhaseFailure(
                phase,
                m.name,
                f"policy pause refused: not every worker is connected ({result.detail or MISSING_WORKERS});"
                " a missing worker may hold model calls nobody can see, so the model cannot be drained —"
                " restart or reconnect its workers, then checkpoint again",
                result.code,
            )
        reply = expect_reply(result, ModelPauseReply, phase, "policy pause")
        if reply.held_by_cut():
            raise _held_by_cut(m, reply.inflight_total)
        return reply

    async def agent(m: Member) -> AgentPrepareReply:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        held = _Held()
        read: tuple[_Refusal, float] | None = None  # the refusal the last status read followed, when
        while True:
            result = await send_call(ctx, attempt, m, "prepare", phase, body=common_body(attempt))
            if result.error == "http" and result.status == 409 and result.code == _AGENT_PREPARE_INCOMPLETE:
                refusal = _Refusal.of(result.detail)
                if not refusal.may_hold:
                    held = _Held()
                # remembered before anything else is awaited: a deadline that ends the phase from
                # here on (the status read, the pause, the next prepare) reports this refusal
                attempt.waiting_on[m.name] = _incomplete(ctx, m, result, held)
                if refusal.read_due(read, time.monotonic()):
                    read = (refusal, time.monotonic())
                    found = await _held_results(ctx, attempt, m, phase)
                    held = found if found is not None else held
                    attempt.waiting_on[m.name] = _incomplete(ctx, m, result, held)
                    if found is not None and found.only and refusal.may_be_only_held:
                        attempt.waiting_on.pop(m.name, None)
                        raise _blocked_by_held(ctx, m, result, found)
                left = attempt.deadline_ts - time.time()
                if left <= AGENT_RETRY_S:
                    raise attempt.waiting_on.pop(m.name)
                await anyio.sleep(min(AGENT_RETRY_S, left))
                continue
            refusal_failure = attempt.waiting_on.pop(m.name, None)
            if refusal_failure is not None and result.error == "timeout":
                # the retry ran into the deadline (every call's timeout is the time left to it):
                # why this agent is not ready is its last refusal, not the cut-off retry
                raise refusal_failure
            reply = expect_reply(result, AgentPrepareReply, phase, "agent prepare")
            if not reply.ready_to_commit:
                raise PhaseFailure(phase, m.name, "agent prepare answered but is not ready_to_commit")
            return reply

    async def resources(m: Member) -> ResourcesPrepareReply:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        result = await send_call(ctx, attempt, m, "prepare", phase, body=common_body(attempt))
        return expect_reply(result, ResourcesPrepareReply, phase, "resources prepare")

    pauses = await each_member(ctx, attempt, attempt.group("policy"), pause)
    agents = await each_member(ctx, attempt, attempt.group("agent"), agent)
    res = await each_member(ctx, attempt, attempt.group("resources"), resources)
    drained = await each_member(
        ctx, attempt, attempt.group("policy"), lambda m: _drain(ctx, attempt, m, pauses[m.name].workers)
    )
    return {
        "policy": {name: {"inflight_at_pause": p.inflight_total} for name, p in pauses.items()},
        "drain": drained,
        "agents": {name: {"parked": a.parked, "active": a.active} for name, a in agents.items()},
        "resources": {name: {"sessions": r.sessions} for name, r in res.items()},
    }


@dataclass(frozen=True)
class _Refusal:
    """The counts an agent's `agent_prepare_incomplete` refusal gives in its detail (Gym's: running,
    parked without a boundary, completed unacknowledged); None for a count it does not give."""

    running: int | None
    parked_without_boundary: int | None
    unacknowledged: int | None

    @classmethod
    def of(cls, detail: str | None) -> "_Refusal":
        counts = {name: int(value) for name, value in _COUNT.findall(detail or "")}
        return cls(
            counts.get("running"),
            counts.get("parked_without_boundary"),
            counts.get("completed_unacknowledged"),
        )

    @property
    def may_hold(self) -> bool:
        """Whether unacknowledged results may be among the reasons (counted, or not said)."""
        return self.unacknowledged is None or self.unacknowledged > 0

    @property
    def may_be_only_held(self) -> bool:
        """Whether they may be the only reason: nothing running, nothing parked without a boundary
        (each counted as 0, or not said — the agent's status then decides)."""
        return self.may_hold and not self.running and not self.parked_without_boundary

    def read_due(self, last: "tuple[_Refusal, float] | None", now: float) -> bool:
        """Whether to read the agent's status now: it may hold results, and this refusal's counts
        differ from those of the refusal the last read followed (or cannot be read, and
        `HELD_READ_S` has passed) — the same blocker is not read, nor counted, again."""
        if not self.may_hold:
            return False
        if last is None:
            return True
        before, at = last
        if self.unacknowledged is None:
            return now - at >= HELD_READ_S
        return self != before


@dataclass(frozen=True)
class _Held:
    """What an agent's status said it holds: the unacknowledged executions it names (`named`), how
    many it counts (`count`: at least as many), and whether nothing else is in flight there (`only`:
    nothing running, nothing parked without a boundary) — no retry can then succeed before they are
    acknowledged."""

    named: tuple[tuple[str, int], ...] = ()
    count: int = 0
    only: bool = False


async def _held_results(ctx: Context, attempt: Attempt, m: Member, phase: str) -> _Held | None:
    """What `m` holds unacknowledged, from its status (a recorded read); None when the read fails."""
    query = StatusQuery(checkpoint_id=attempt.checkpoint_id)
    result = await send_call(ctx, attempt, m, "status", phase, params=query.model_dump(exclude_none=True))
    if not (result.ok and isinstance(result.reply, AgentStatusReply)):
        return None
    reply = result.reply
    named: list[tuple[str, int]] = []
    for entry in reply.completed_unacknowledged_attempts:
        if isinstance(entry, dict) and isinstance(entry.get("rollout_id"), str):
            attempt_index = entry.get("attempt_index")
            if isinstance(attempt_index, int):
                named.append((entry["rollout_id"], attempt_index))
    count = max(reply.completed_unacknowledged, len(named))
    only = count > 0 and reply.running == 0 and reply.parked_without_boundary == 0
    return _Held(tuple(named), count, only)


def _incomplete(ctx: Context, m: Member, result: CallResult, held: _Held) -> PhaseFailure:
    """An agent's `agent_prepare_incomplete` refusal as the prepare's failure at the deadline."""
    reason = "agent never became ready to commit before the deadline (agent_prepare_incomplete"
    reason += f": {result.detail})" if result.detail else ")"
    if held.count:
        reason += f"; {_held_text(ctx, m, held)}"
    return PhaseFailure("prepare", m.name, reason, result.code, deadline=True)


def _blocked_by_held(ctx: Context, m: Member, result: CallResult, held: _Held) -> PhaseFailure:
    """An agent refused only because of results nobody acknowledged: the prepare fails at once."""
    detail = f" (agent_prepare_incomplete: {result.detail})" if result.detail else ""
    reason = (
        f"agent cannot become ready to commit{detail}: nothing but finished results nobody has"
        f" acknowledged keeps it from it, so no retry can succeed until they are; {_held_text(ctx, m, held)}"
    )
    return PhaseFailure("prepare", m.name, reason, result.code)


def _held_text(ctx: Context, m: Member, held: _Held) -> str:
    """Which results an agent holds unacknowledged (the first `NAMED_EXECUTIONS`, and the count),
    and the two ways to acknowledge them."""
    shown = held.named[:NAMED_EXECUTIONS]
    ids = [f"{rollout}:{index}" for rollout, index in shown]
    more = f" and {held.count - len(shown)} more" if held.count > len(shown) else ""
    named = f": {' '.join(ids)}{more}" if ids else " (its status names none of them)"
    if not ids:
        return (
            f"it holds {count(held.count, 'finished rollout result')} nobody has acknowledged{named}"
            " — Gym keeps a finished result until its consumer confirms it has it; acknowledge them"
            " (`Coordinator.acknowledge_completed`), then checkpoint again"
        )
    pairs = ", ".join(f"({rollout!r}, {index})" for rollout, index in shown)
    shell = command_line(None, "acknowledge", m.name, *ids, service=ctx.service)
    return (
        f"it holds {count(held.count, 'finished rollout result')} nobody has acknowledged{named} — Gym keeps"
        " a finished result until its consumer confirms it has it. Once the trainer holds those"
        f" results, acknowledge them — from the trainer: `await coord.acknowledge_completed({m.name!r},"
        f" [{pairs}])`; from a shell: `{shell}` — then checkpoint again"
        + (f" (it names the other {held.count - len(shown)})" if more else "")
    )


def _held_by_cut(m: Member, inflight: int) -> PhaseFailure:
    """A policy model paused by Gym's generation cut: its calls in flight never drain before resume."""
    return PhaseFailure(
        "prepare",
        m.name,
        f"the policy model paused by a generation cut: {count(inflight, 'model call')} in flight were cut"
        " and their responses are held until resume, so the model never drains. A cut's partial"
        " generations are kept by the trainer that runs Gym's generation-cut backend (NeMo RL), not"
        " in the model's checkpoint files, so quiesce cannot save them — run the policy model"
        " without a generation-cut backend (Gym then drains the calls in flight), then checkpoint"
        " again",
    )


async def _drain(ctx: Context, attempt: Attempt, m: Member, workers: Workers) -> dict[str, Any]:
    """Repeat the status long-poll (each ≤ the time left) until the reply shows the model drained:
    paused, nothing in flight, every worker there and acknowledged (`not_drained`). A reply
    naming another checkpoint id is a failed call (`calls.py`)."""
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
        result = await send_call(
            ctx,
            attempt,
            m,
            "status",
            phase,
            params=query.model_dump(exclude_none=True),
            expect_checkpoint=attempt.checkpoint_id,
        )
        polls += 1
        reply = expect_reply(result, ModelStatusReply, phase, "policy status")
        attempt.inflight = reply.inflight_total
        ctx.progress(
            Progress(attempt.checkpoint_id, phase, m.name, inflight=reply.inflight_total, state=reply.state)
        )
        if reply.held_by_cut():
            raise _held_by_cut(m, reply.inflight_total)
        problem = reply.not_drained(workers)
        if problem is None:
            return {"polls": polls, "state": reply.state}
        if attempt.deadline_ts - time.time() <= POLL_MARGIN_S:
            # no time for another poll whose reply could arrive before the deadline: the drain
            # waits the deadline out (sending nothing after it), then fails
            await anyio.sleep(max(0.0, attempt.deadline_ts - time.time()))
            raise PhaseFailure(
                phase, m.name, f"the drain did not finish before the deadline: {problem}", deadline=True
            )
        if time.monotonic() - started < 0.01:
            await anyio.sleep(0.05)


async def commit(ctx: Context, attempt: Attempt) -> None:
    """Commit: agents → policy (with the continuation indexes of its folder's agents) → resources;
    each role group's manifest digests and artifact references are verified before the next group
    is called.

    The staging folder (durable, with each server's folder in it: made beside the prepare phase,
    `staging.py`) is there first; a failure rolls back and removes it.
    """
    require_state(attempt, ("prepared",), "commit")
    assert attempt.staging_dir is not None

    async def body() -> None:
        await made_for_commit(attempt)
        await run_phase(ctx, attempt, "commit", lambda: _commit_body(ctx, attempt))

    await rolled_back_on_failure(ctx, attempt, "commit", body)
    attempt.state = "committed"


async def _commit_body(ctx: Context, attempt: Attempt) -> dict[str, Any]:
    phase = "commit"
    staging = attempt.staging_dir
    assert staging is not None

    def checkpoint_dir(m: Member) -> str:
        return os.path.join(staging, m.folder) if m.folder else str(staging)

    def dir_body(m: Member) -> CheckpointDirBody:
        return CheckpointDirBody(
            checkpoint_id=attempt.checkpoint_id,
            deadline_ts=attempt.deadline_ts,
            checkpoint_dir=checkpoint_dir(m),
        )

    def record(m: Member, reply: BaseModel, digest: str, refs: dict[str, ArtifactRef | None]) -> None:
        own = manifest_path(m.component, m.gym_name)
        entry: dict[str, Any] = {
            "name": m.name,
            "component": m.component,
            "role": m.role,
            **({"folder": m.folder} if m.folder else {}),
            "manifest": f"{m.folder}/{own}" if m.folder else own,
            "manifest_digest": digest,
            "reply": reply.model_dump(mode="json"),
        }
        for key, ref in refs.items():
            if ref is not None:
                entry[key] = ref.model_dump(mode="json")
        attempt.commits[m.name] = entry

    async def verify(group: Sequence[Member], rows: dict[str, list[ContinuationRow]] | None = None) -> None:
        # one pass (one worker thread) per role group, before the next group is called: the
        # agents' continuation indexes are checked (and, with `rows`, read into it) before they
        # go to the model's commit
        entries = [attempt.commits[m.name] for m in group if m.name in attempt.commits]

        def check() -> list[tuple[str, list[str]]]:
            return [(e["name"], _verify_entry(staging, e, attempt.digests, rows=rows)) for e in entries]

        for name, problems in await anyio.to_thread.run_sync(check):
            if problems:
                raise PhaseFailure(phase, name, "; ".join(problems))

    async def agent(m: Member) -> AgentCommitReply:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        result = await send_call(ctx, attempt, m, "commit", phase, body=dir_body(m))
        reply = expect_reply(result, AgentCommitReply, phase, "agent commit")
        record(m, reply, reply.manifest_digest, {"continuation_index": reply.continuation_index})
        return reply

    agents = await each_member(ctx, attempt, attempt.group("agent"), agent)
    rows: dict[str, list[ContinuationRow]] = {}
    await verify(attempt.group("agent"), rows)
    # a model is handed the indexes of its own deployment's agents only: those of its folder
    indexes: dict[str, list[ArtifactRef]] = {}
    for a in attempt.group("agent"):
        indexes.setdefault(a.folder, []).append(agents[a.name].continuation_index)

    async def policy(m: Member) -> ModelCommitReply:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        body = ModelCommitBody(
            checkpoint_id=attempt.checkpoint_id,
            deadline_ts=attempt.deadline_ts,
            checkpoint_dir=checkpoint_dir(m),
            continuation_indexes=indexes.get(m.folder, []),
        )
        result = await send_call(ctx, attempt, m, "commit", phase, body=body)
        reply = expect_reply(result, ModelCommitReply, phase, "model commit")
        record(m, reply, reply.manifest_digest, {"storage_reference_index": reply.storage_reference_index})
        return reply

    exporters = tuple(m for m in attempt.group("policy") if m.exports)  # not a drain-only model

    async def resources(m: Member) -> ResourcesCommitReply:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        result = await send_call(ctx, attempt, m, "commit", phase, body=dir_body(m))
        reply = expect_reply(result, ResourcesCommitReply, phase, "resources commit")
        record(m, reply, reply.manifest_digest, {})
        return reply

    models = await each_member(ctx, attempt, exporters, policy)
    await verify(exporters)
    res = await each_member(ctx, attempt, attempt.group("resources"), resources)
    await verify(attempt.group("resources"))
    # staged like the unified plane's `episodes.exported`, just before this phase's
    # `phase.completed`: committed no later than it (seq order), so a ledger holding the commit
    # as completed holds what it captured
    await ctx.ledger.stage(
        "rollouts.captured",
        checkpoint_id=attempt.checkpoint_id,
        data={
            "captured": {
                m.name: [{"rollout_id": r.rollout_id, "attempt": r.attempt_index} for r in rows[m.name]]
                for m in attempt.group("agent")
            }
        },
    )
    return {
        "agents": {n: {"records": a.records} for n, a in agents.items()},
        "policy": {
            n: {
                "rollouts": p.rollouts,
                "rows": p.rows,
                "storage_reference_index": (
                    p.storage_reference_index.model_dump(mode="json") if p.storage_reference_index else None
                ),
            }
            for n, p in models.items()
        },
        "resources": {n: {"sessions": r.sessions} for n, r in res.items()},
    }


def _verify_entry(
    staging: Path,
    entry: dict[str, Any],
    cache: DigestCache | None = None,
    *,
    walk: bool = True,
    rows: dict[str, list[ContinuationRow]] | None = None,
) -> list[str]:
    """A participant's manifest digest and artifact references against the files in `staging`
    (read now, or taken from `cache` for a file unchanged since it was read). Its manifest is named
    relative to `staging` (its folder first); its artifact references relative to its folder
    (`entry["folder"]`), where it was committed.

    With `walk` (the default) its own folder is walked too: it may hold only what can be
    published. `walk=False` only where the whole tree was just refused for any such entry
    (`tree_digests(strict=True)`, which publish runs first).

    With `rows` (the commit's check of an agent), its continuation index is read once and must
    also be continuation rows, every record (`continuation_index_rows`); they go into
    `rows[name]` when it holds no problem."""
    name = entry["name"]
    problems: list[str] = []
    rel = entry["manifest"]
    if walk:
        # its own folder holds only what can be published (no symlink, FIFO, socket, device, outside link)
        parts = PurePosixPath(rel).parent.parts
        folder = staging.joinpath(*parts)
        # the first folder on the way down from `staging` that is a symlink (lstat of each, no Path
        # arithmetic: this runs for every participant of every commit)
        base = os.fspath(staging)
        linked = next(
            (i for i in range(1, len(parts) + 1) if os.path.islink(os.path.join(base, *parts[:i]))), 0
        )
        if linked:
            problems.append(f"{name}: {'/'.join(parts[:linked])} is a symlink, not a folder")
        elif folder.is_dir():
            problems.extend(
                f"{name}: {folder.relative_to(staging).as_posix()}/{odd}" for odd in unpublishable(folder)
            )
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
    own = entry.get("folder")
    root = staging / own if isinstance(own, str) and own else staging
    for key in ("continuation_index", "storage_reference_index"):
        if key in entry:
            try:
                ref = ArtifactRef.model_validate(entry[key])
            except ValidationError:
                problems.append(f"{name}: {key} is not a valid artifact reference")
                continue
            what = f"{name} {key}" + (f" (in folder {own})" if root != staging else "")
            if rows is not None and key == "continuation_index":
                read = continuation_index_rows(root, ref, what=what, cache=cache)
                if isinstance(read, str):
                    problems.append(read)
                else:
                    rows[name] = read
                continue
            problem = verify_artifact(root, ref, what=what, cache=cache)
            if problem:
                problems.append(problem)
    return problems


def continuation_index_rows(
    staging: Path, ref: ArtifactRef, *, what: str, cache: DigestCache | None = None
) -> list[ContinuationRow] | str:
    """An agent's continuation index checked as `publish.verify_artifact` checks an artifact —
    a regular file (never through a symlink) of the reference's bytes, sha256 and records (its
    non-empty lines) — and parsed from the same bytes, read once: every record must be a
    continuation row. Returns its rows, or the first problem (a file that is not rows fails the
    commit like a digest that differs).

    Its size and sha256 go into `cache` by its rules (`digests.regular_bytes`), so publication
    hashes it no more; its record count is not kept there (publication's check counts it again)."""
    rel = ref.relative_path
    read = regular_bytes(staging / rel, cache=cache)
    if read == "not a regular file":
        return f"{what}: {rel} is missing (not a regular file)"
    if isinstance(read, str):  # missing, or cannot be read
        return f"{what}: {rel} {'is missing' if read == 'missing' else read}"
    data, facts = read
    if facts.size != ref.bytes:
        return f"{what}: {rel} has {facts.size} bytes, the reply says {ref.bytes}"
    if facts.sha256 != ref.sha256:
        return f"{what}: {rel} sha256 {facts.sha256[:12]}… differs from the reply's {ref.sha256[:12]}…"
    records = sum(1 for line in data.split(b"\n") if line.strip())
    if records != ref.records:
        return f"{what}: {rel} has {records} records, the reply says {ref.records}"
    try:
        return continuation_rows(rel, data)
    except ValueError as error:
        return f"{what}: a record is not a continuation row: {error}"


def _owner(attempt: Attempt, entries: Sequence[str]) -> str | None:
    """The participant whose own folder holds the first of `entries` (relative paths first), or
    None: the caller's half, or the staging folder itself."""
    if not entries:
        return None
    first = entries[0].split(": ", 1)[0]
    for entry in attempt.commits.values():
        folder = Path(entry["manifest"]).parent.as_posix() + "/"
        if first.startswith(folder):
            return str(entry["name"])
    return None


def final_dir_of(staging: Path, *, in_place: bool = False) -> Path:
    """Where a save's staging folder `<snapshots>/.staging/<id>` is renamed to: `<snapshots>/<id>`;
    a save committed in place is published where it was staged.

    The one rule `publish` and recovery share. It reads only the staging folder, which the durable
    `attempt.started` records, so recovery finds a publication even when the ledger kept no
    `attempt.publishing` and the configured snapshot folder has changed since."""
    return staging if in_place else staging.parent.parent / staging.name


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
    require_state(attempt, ("committed",), "publish")
    if attempt.in_place:
        return await _publish_in_place(ctx, attempt)
    staging = attempt.staging_dir
    assert staging is not None
    final = final_dir_of(staging)
    await ctx.ledger.stage("phase.started", checkpoint_id=attempt.checkpoint_id, data={"phase": "publish"})
    ctx.progress(Progress(attempt.checkpoint_id, "publish", step="phase", deadline_ts=attempt.deadline_ts))
    written: list[bytes] = []
    manifests: list[dict[str, Any]] = []

    async def body() -> None:
        entries = list(attempt.commits.values())

        def verify() -> tuple[dict[str, tuple[int, str]], list[str]]:
            # one pass hashes (what commit did not) and fsyncs every file and folder; the checks
            # and the manifest reuse it. Strict: it refuses anything unpublishable anywhere in the
            # tree, so the participants' own folders need no walk of their own
            cache = attempt.digests
            digests = tree_digests(staging, sync=True, skip=[MANIFEST], cache=cache, strict=True)
            return digests, [p for entry in entries for p in _verify_entry(staging, entry, cache, walk=False)]

        digests = await _verified(attempt, verify, f"the staging folder {staging}")
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
        written.append(await _write_manifest(staging / MANIFEST, manifest))
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
            await anyio.to_thread.run_sync(rename_into_place, staging, final, attempt.staging_identity)
        except (OSError, SnapshotError) as error:
            # the rename is the commit point: if it happened (the error came after it), it is published
            if staging.exists() or not (final / MANIFEST).is_file():
                raise PhaseFailure("publish", None, f"cannot rename {staging} to {final}: {error}") from None

    try:
        await rolled_back_on_failure(ctx, attempt, "publish", body)
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
    total = sum(f["bytes"] for f in manifest["files"])

    def point_latest() -> None:
        write_latest(ctx.config.snapshots, final.name)
        remember_snapshot_bytes(final, total)  # the next save's preflight reads no manifest for it

    await anyio.to_thread.run_sync(point_latest)
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
    ctx.progress(Progress(attempt.checkpoint_id, "publish", step="done"))
    return final


#: hashes, fsyncs and checks a staged tree (on a worker thread): its digests and the problems found
Verify = Callable[[], tuple[dict[str, tuple[int, str]], list[str]]]


async def _verified(attempt: Attempt, verify: Verify, what: str) -> dict[str, tuple[int, str]]:
    """`verify()`'s digests (it hashes and fsyncs the tree and checks every commit entry, on a
    worker thread) once the staging folder is still the one the attempt made; any problem is a
    publish `PhaseFailure` naming the server it concerns. Nothing is walked, hashed or renamed
    through a symlink put in the staging folder's place."""
    staging = attempt.staging_dir
    assert staging is not None
    replaced = await anyio.to_thread.run_sync(staging_problem, staging, attempt.staging_identity)
    if replaced is not None:
        raise PhaseFailure("publish", None, replaced)
    try:
        digests, problems = await anyio.to_thread.run_sync(verify)
    except OSError as error:
        raise PhaseFailure("publish", None, f"cannot read {what}: {error}") from None
    except SnapshotError as error:  # a symlink, FIFO, socket, device or outside hard link
        raise PhaseFailure("publish", _owner(attempt, error.differences), str(error)) from None
    if problems:
        named = problems[0].split(":")[0].split(" ")[0]
        server = next((n for n in attempt.commits if n == named), next(iter(attempt.commits)))
        raise PhaseFailure("publish", server, "; ".join(problems))
    return digests


async def _write_manifest(path: Path, manifest: dict[str, Any]) -> bytes:
    """Write a snapshot manifest durably (`write_json_durably`); the bytes written, or a publish
    `PhaseFailure` saying what the filesystem refused."""
    try:
        return await anyio.to_thread.run_sync(write_json_durably, path, manifest)
    except OSError as error:
        raise PhaseFailure(
            "publish", None, f"cannot write the snapshot manifest in {path.parent}: {error}"
        ) from None


async def _publish_in_place(ctx: Context, attempt: Attempt) -> Path:
    """Publish a save committed into its caller's folder (`Coordinator.save(into=...)`), in place.

    The servers' folders (`attempt.staging_roots`) are verified, hashed and made durable like a
    staging folder, then `quiesce-manifest.json` — listing only them, with `in_place` and `roots` —
    is written durably into the folder: that write is the commit point (recovery reads it from the
    filesystem, `final_dir_of` the folder being the folder itself). Nothing is renamed, LATEST and
    retention are left alone, and nothing else in the folder is read or written: the folder, and
    its publication as a whole, are the caller's. A failure before the manifest is on disk rolls
    back: the servers' folders and the manifest are removed, never the caller's files.
    """
    staging = attempt.staging_dir
    roots = attempt.staging_roots
    assert staging is not None
    assert roots is not None
    await ctx.ledger.stage("phase.started", checkpoint_id=attempt.checkpoint_id, data={"phase": "publish"})
    ctx.progress(Progress(attempt.checkpoint_id, "publish", step="phase", deadline_ts=attempt.deadline_ts))
    written: list[bytes] = []
    files: list[int] = []

    async def body() -> None:
        entries = list(attempt.commits.values())

        def verify() -> tuple[dict[str, tuple[int, str]], list[str]]:
            cache = attempt.digests
            digests: dict[str, tuple[int, str]] = {}
            for root in roots:
                found = tree_digests(staging / root, sync=True, cache=cache, strict=True)
                digests.update((f"{root}/{rel}", value) for rel, value in found.items())
                parts = root.split("/")
                for depth in range(len(parts) - 1, -1, -1):  # the entries leading to the root
                    fsync_dir(staging.joinpath(*parts[:depth]))
            return digests, [p for entry in entries for p in _verify_entry(staging, entry, cache, walk=False)]

        digests = await _verified(attempt, verify, f"the servers' folders in {staging}")
        ledger_seq = await ctx.ledger.last_seq()
        manifest = build_manifest(
            staging,
            checkpoint_id=attempt.checkpoint_id,
            created=utc_now(),
            epoch=ctx.ledger.epoch,
            ledger_seq=ledger_seq,
            participants=entries,
            skipped=attempt.skipped,
            digests=digests,
        )
        manifest["in_place"] = True
        manifest["roots"] = roots
        files.append(len(manifest["files"]))
        written.append(await _write_manifest(staging / IN_PLACE_MANIFEST, manifest))
        await ctx.ledger.stage(
            "attempt.publishing",
            checkpoint_id=attempt.checkpoint_id,
            data={"staging_dir": str(staging), "final_dir": str(staging)},
        )

    try:
        await rolled_back_on_failure(ctx, attempt, "publish", body)
    finally:
        attempt.digests.clear()
    await ctx.ledger.stage(
        "attempt.published",
        checkpoint_id=attempt.checkpoint_id,
        data={"final_dir": str(staging), "manifest_sha256": hashlib.sha256(written[0]).hexdigest()},
    )
    attempt.state = "published"
    attempt.snapshot = staging
    await ctx.ledger.stage(
        "phase.completed",
        checkpoint_id=attempt.checkpoint_id,
        data={
            "phase": "publish",
            "summary": {"final_dir": str(staging), "files": files[0], "in_place": True, "roots": roots},
        },
    )
    ctx.progress(Progress(attempt.checkpoint_id, "publish", step="done"))
    return staging


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
