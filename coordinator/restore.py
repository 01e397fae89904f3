"""A restore: policy → agents → resources under a new checkpoint id; the servers stay paused.

Each server restores from its folder of the snapshot as the publication recorded it
(`Snapshot.folders`: where it committed; the snapshot itself without one), and every file of a
server read here — its agent records, its continuation index — is read there; the artifact
references a server gave are relative to that folder.

The caller verifies the snapshot before any call. Each reply is checked against the snapshot: a
reply naming another checkpoint than the snapshot's is a failed call (`calls.py`); each agent's
`continuation_index` and each policy model's `storage_reference_index` must equal the committed
one. The model restore asks for its index (`include_storage_reference_index: true`, the anchor's
opt-in); a later Gym, which always returns it, refuses that field with 422 — then the restore is
sent again without it (a 422 ran nothing). An index committed but not returned, or returned
different, fails the restore, as RL does. Only participants that export state take part: a
drain-only policy model is neither restored nor paused by a restore.

A failed restore is never rolled back — half-restored state must not run: `attempt.aborted`
lists every server it may have restored as `left_paused`, and only an explicit resume (or a new
restore) lets them go.

A restore is terminal only when nothing is left to do for it: `attempt.completed {restored}` is
written when the servers are explicitly left paused for the caller; a restore asked to resume too
(`resume=True`, recorded in `attempt.started`) writes no such record — its resume phase follows at
once and its one terminal record is `attempt.completed {resumed}`, so a death anywhere before
that leaves it unfinished for recovery, which re-drives the restore if needed and resumes.
`redrive` runs the restore phase once more under the same id (recovery, `quiesce resume ID`).

A server restarted between the restore and its resume is restored again first: every resume of
a restore (`resume.finish_resume`) reads the fences of the participants not yet resumed, and one
that holds nothing of the restore — a fresh process — is restored again under the same id from
the snapshot before any server is resumed (`reinstate`); if it cannot be, no server is resumed.

What to send again: Gym's agent restore runs no restored rollout by itself. It retires each saved
execution (rollout, n) and keeps the saved boundary for (rollout, n+1), which continues only when
the trainer sends that `/run`. A successful restore therefore lists those executions
(`Attempt.resubmit`, `read_resubmissions`), read from the snapshot's agent folders as Gym writes
them — `manifest.json`'s `files` (record file name → sha256), each record naming its `rollout_id`
and `attempt_index` — after the snapshot's digests were verified and before any server is
contacted. The list is a convenience — the snapshot's digests are what make it safe to restore:
an agent folder it cannot be read from (another layout, a file that is not a boundary record, an
identity that is not its file name `<rollout_id>.a<attempt_index>.json`) leaves that agent's
resubmissions unknown, with the reason (`Attempt.resubmit_unknown`), and the restore goes on. A
record that is missing or whose digest is not the agent manifest's refuses the restore
(`SnapshotError`): nothing is restored, nothing resumed.

What to start afresh: a saved turn that depends on a `restart_only` resources server cannot
continue — that server comes back empty. An agent that declares `discard_restored_continuation_v1`
and `agent_resource_dependency_index_v1` drops such a continuation on request, only while it is
`restored_paused` under the restore's id; so, last in the restore phase, each continuation whose
row in the agent's committed continuation index names a `restart_only` resources server of the
cluster (or does not say, `resource_state_revisions` null) is discarded (`discards`, one recorded
call each, `POST /agent-checkpoint/discard-restored-continuation {rollout_id, attempt_index: n+1}`)
and listed in `Attempt.restart` — its `/run` starts from the task — instead of `resubmit`. A
discard that fails fails the restore (the saved turn would run against an empty server).

What the ledger keeps of both: once the restore phase succeeded, `rollouts.continued` records,
with the snapshot's checkpoint id, per agent the executions it continues (`attempt.resubmit`),
those it discarded (`attempt.restart`) and the agents whose folder does not say
(`attempt.resubmit_unknown`, with the reason). It is staged as the phase's last record, just
before its `phase.completed`: committed no later than that record, so before any server is resumed.
A re-drive of the phase (`redrive`: recovery, `quiesce resume ID`, a server restored again) appends
it only when the ledger holds none for the attempt — one per restore, whichever process finished it.
"""

import re
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from pydantic import ValidationError

from quiesce.coordinator.attempt import (
    Attempt,
    Context,
    PhaseFailure,
    Progress,
    Resubmission,
    UnknownResubmissions,
    anyio_deadline,
    each_member,
    expect_reply,
    free_command,
    next_checkpoint_id,
    record_phase_failed,
    recovery_budget,
    run_phase,
    send_call,
)
from quiesce.coordinator.calls import CallResult
from quiesce.coordinator.digests import file_digest
from quiesce.coordinator.discovery import Discovery, Member
from quiesce.coordinator.errors import DeadlineExceeded, FencedError, LedgerError, PhaseError, SnapshotError
from quiesce.coordinator.phases import Role
from quiesce.coordinator.protocol import (
    AGENT,
    AGENT_RESOURCE_DEPENDENCY_INDEX,
    DISCARD_RESTORED_CONTINUATION,
    INCLUDE_STORAGE_REFERENCE_INDEX,
    STALE_CHECKPOINT,
    AgentManifest,
    AgentRecordIdentity,
    AgentRestoreReply,
    ArtifactRef,
    Capabilities,
    CheckpointDirBody,
    ContinuationRow,
    DiscardContinuationBody,
    DiscardContinuationReply,
    ModelRestoreBody,
    ModelRestoreReply,
    ResourcesRestoreReply,
    agent_instance_dir,
    agent_record_file,
    sha256_hex,
)
from quiesce.coordinator.provenance import check_provenance
from quiesce.coordinator.publish import (
    MANIFEST,
    Snapshot,
    load_snapshot,
    read_latest,
    verify_snapshot,
)
from quiesce.coordinator.stranded import stranded

# ---------------------------------------------------------------------------------------------
# Restore
# ---------------------------------------------------------------------------------------------


async def restore(
    ctx: Context,
    discovery: Discovery,
    snapshot: Snapshot,
    *,
    deadline_s: float | None = None,
    warnings: Sequence[str] = (),
    resume: bool = False,
    manifest_sha256: str | None = None,
    resubmit: Sequence[Resubmission] = (),
    unknown: Sequence[UnknownResubmissions] = (),
    restart_only: Sequence[str] = (),
    discarding: Sequence[str] = (),
) -> Attempt:
    """Restore a verified snapshot: policy → agents → resources under a new id; servers stay paused.

    The caller verifies the snapshot first (`publish.verify_snapshot`) — before any call. Replies are
    checked against the snapshot: source checkpoint id, and each agent's continuation index.
    With `resume` the attempt is left in state `restored` without a terminal record: the caller
    resumes it next (`resume.finish_resume`), and `attempt.started` says so for recovery.
    `resubmit` and `unknown` (`read_resubmissions` of the same snapshot) become `attempt.resubmit`
    and `attempt.resubmit_unknown` once the restore phase succeeded, less the continuations it
    discarded (`attempt.restart`): `restart_only` names the cluster's `restart_only` resources
    servers and `discarding` the agents that can discard (`can_discard`), both recorded in
    `attempt.started` so a later process re-drives the same plan (the caller checked it first,
    `discard_plan`).
    """
    checkpoint_id = await next_checkpoint_id(ctx.ledger)
    deadline_ts = time.time() + (deadline_s if deadline_s is not None else ctx.config.deadline_s)
    attempt = Attempt(
        checkpoint_id=checkpoint_id,
        kind="restore",
        deadline_ts=deadline_ts,
        participants=discovery.exporters,
        snapshot=snapshot.path,
        source_checkpoint_id=snapshot.checkpoint_id,
        snapshot_sha256=manifest_sha256,
        warnings=list(warnings),
        restart_only=tuple(restart_only),
        discarding=tuple(discarding),
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
            **({"manifest_sha256": manifest_sha256} if manifest_sha256 else {}),
            **({"warnings": list(warnings)} if warnings else {}),
            **({"resume": True} if resume else {}),
            **({"restart_only": list(restart_only)} if restart_only else {}),
            **({"discarding": list(discarding)} if discarding else {}),
        },
        durable=True,  # see "Durability" in attempt.py
    )

    async def body() -> dict[str, Any]:
        summary = await restore_body(ctx, attempt, snapshot)
        await _stage_continued(ctx, attempt, snapshot, resubmit, unknown)
        return summary

    try:
        await run_phase(ctx, attempt, "restore", body)
    except FencedError:
        raise
    except PhaseFailure as failure:
        reason = f"restore failed at {failure.server or 'the coordinator'}: {failure.reason}"
        held = attempt.may_hold
        never = [name for name in attempt.touched if name in attempt.refused]
        try:
            await record_phase_failed(
                ctx, checkpoint_id, "restore", failure.server, failure.reason, failure.code
            )
            await ctx.ledger.append(
                "attempt.aborted",
                checkpoint_id=checkpoint_id,
                data={"reason": reason, "resumed": [], "left_paused": held, "not_paused": never},
            )
        except FencedError:
            raise
        except LedgerError as lost:
            raise stranded(ctx, attempt, lost) from None
        attempt.state = "aborted"
        cls = DeadlineExceeded if failure.deadline else PhaseError
        untouched = f" Never restored (the request was refused): {', '.join(never)}." if never else ""
        way_out = (
            " Restart them and restore again, or run"
            f" `{free_command(ctx, 'resume', checkpoint_id)}` to run them as they are."
            if held
            else ""
        )
        raise cls(
            f"restore {checkpoint_id} of snapshot {snapshot.path} failed: {reason}. Servers contacted stay"
            f" paused (half-restored state must not run): {', '.join(held) or 'none'}.{untouched}{way_out}",
            phase="restore",
            server=failure.server,
            reason=failure.reason,
            code=failure.code,
            checkpoint_id=checkpoint_id,
            resumed=never,
            not_resumed=held,
            latest_snapshot=str(read_latest(ctx.config.snapshots) or "") or None,
            warnings=attempt.warnings,
        ) from None
    except BaseException as exc:  # cancelled or a bug: record what is left paused, then re-raise
        with anyio.CancelScope(shield=True):
            try:
                await ctx.ledger.append(
                    "attempt.aborted",
                    checkpoint_id=checkpoint_id,
                    data={
                        "reason": f"restore interrupted: {type(exc).__name__}: {exc}",
                        "resumed": [],
                        "left_paused": attempt.may_hold,
                        "not_paused": [name for name in attempt.touched if name in attempt.refused],
                    },
                )
            except FencedError:
                raise
            except LedgerError as lost:  # e.g. a full disk: nothing more can be recorded
                if isinstance(exc, LedgerError):
                    raise stranded(ctx, attempt, exc) from None
                exc.add_note(str(stranded(ctx, attempt, lost)))
        attempt.state = "aborted"
        raise
    if not resume:  # explicitly left paused for the caller: terminal now
        await ctx.ledger.append(
            "attempt.completed",
            checkpoint_id=checkpoint_id,
            data={"servers": attempt.touched, "outcome": "restored"},
        )
    attempt.state = "restored"
    restarted = set(attempt.restart)
    attempt.resubmit = tuple(r for r in resubmit if r not in restarted)
    attempt.resubmit_unknown = tuple(unknown)
    return attempt


@dataclass(frozen=True)
class Resubmissions:
    """What a restore of a snapshot continues (`read_resubmissions`): the executions to send again,
    and the agents whose folder does not say (each with the reason)."""

    known: tuple[Resubmission, ...] = ()
    unknown: tuple[UnknownResubmissions, ...] = ()


def read_resubmissions(snapshot: Snapshot, agents: Sequence[Member]) -> Resubmissions:
    """The executions a restore of `snapshot` continues, to send again (module docstring): for each
    agent of `agents` (in order), each saved record's (rollout_id, attempt_index + 1), sorted.

    Call it on a verified snapshot (its files match its manifest). The list is a convenience, so
    an agent folder it cannot be read from — no Gym agent manifest with `files` (another layout),
    a named file that is not a boundary record, an identity that is not its file name, a name
    outside the folder — makes that agent's resubmissions unknown, with the reason
    (`Resubmissions.unknown`), and the restore goes on. The agent's continuation index, when its
    manifest lists it among `files` too (with the digest its reference names), is not a record.
    A record the agent's manifest names that is missing, or whose sha256 is not the one that
    manifest names, is damage the snapshot's digests cannot show: `SnapshotError`, listing every
    such record, and nothing is restored.
    """
    found: list[Resubmission] = []
    unknown: list[UnknownResubmissions] = []
    damaged: list[str] = []
    folders = snapshot.folders
    for member in agents:
        if member.component != AGENT:
            continue
        base, folder = _agent_dirs(snapshot, member, folders.get(member.name, ""))
        rel = f"{folder}/manifest.json"
        try:
            manifest = AgentManifest.model_validate_json((base / rel).read_bytes())
        except OSError as error:
            unknown.append(
                UnknownResubmissions(member.name, f"{rel} cannot be read: {error.strerror or error}")
            )
            continue
        except ValueError as error:
            unknown.append(
                UnknownResubmissions(
                    member.name, f"{rel} is not a Gym agent manifest with record files: {_first(error)}"
                )
            )
            continue
        index = manifest.continuation_index
        mine: list[Resubmission] = []
        unreadable: list[str] = []
        for name, digest in sorted(manifest.files.items()):
            record = f"{folder}/{name}"
            if "/" in name or name in ("", ".", ".."):
                unreadable.append(f"{rel} names a record file outside its folder: {name!r}")
                continue
            if record == index.relative_path and digest == index.sha256:
                continue  # the continuation index listed among the files: not a record
            try:
                data = (base / record).read_bytes()
            except OSError as error:
                damaged.append(f"{member.name}: {record} cannot be read: {error.strerror or error}")
                continue
            if sha256_hex(data) != digest:
                damaged.append(f"{member.name}: {record}: sha256 differs from the agent's manifest")
                continue
            try:
                identity = AgentRecordIdentity.model_validate_json(data)
            except ValueError as error:
                unreadable.append(
                    f"{record} is not a boundary record (rollout_id, attempt_index): {_first(error)}"
                )
                continue
            named = agent_record_file(identity.rollout_id, identity.attempt_index)
            if named != name:
                unreadable.append(
                    f"{record} holds rollout {identity.rollout_id!r} attempt {identity.attempt_index},"
                    f" whose file would be {named!r}: its identity disagrees with its name"
                )
                continue
            mine.append(Resubmission(member.name, identity.rollout_id, identity.attempt_index + 1))
        if unreadable:
            unknown.append(UnknownResubmissions(member.name, "; ".join(unreadable)))
        else:
            found.extend(sorted(mine, key=lambda r: (r.rollout_id, r.attempt_index)))
    if damaged:
        raise SnapshotError(
            f"snapshot {snapshot.path} cannot be restored: its agent records are not the ones their"
            " agents committed:\n  " + "\n  ".join(damaged) + "\nNothing was restored and no server was"
            " contacted; restore a snapshot you trust",
            damaged,
        )
    return Resubmissions(tuple(found), tuple(unknown))


#: An agent's instance folder, relative to its checkpoint dir (`protocol.agent_instance_dir`).
_AGENT_DIR = re.compile(r"agent/instance-[0-9a-f]{64}")


def _agent_dirs(snapshot: Snapshot, member: Member, folder: str) -> tuple[Path, str]:
    """Where an agent of `snapshot` restores from — its recorded `folder` of the snapshot — and its
    instance folder relative to that: the one its commit recorded its manifest in (it wrote under
    the name it reported), else the one of the name it reports now (`Member.gym_name`)."""
    base = snapshot.path / folder if folder else snapshot.path
    recorded = (snapshot.participant(member.name) or {}).get("manifest")
    prefix, suffix = (f"{folder}/" if folder else ""), "/manifest.json"
    if isinstance(recorded, str) and recorded.startswith(prefix) and recorded.endswith(suffix):
        instance = recorded[len(prefix) : -len(suffix)]
        if _AGENT_DIR.fullmatch(instance):
            return base, instance
    return base, agent_instance_dir(member.gym_name)


def can_discard(member: Member) -> bool:
    """Whether an agent drops a restored continuation on request and says what each depends on."""
    wanted = {DISCARD_RESTORED_CONTINUATION, AGENT_RESOURCE_DEPENDENCY_INDEX}
    return member.component == AGENT and wanted <= set(member.features)


def discards(snapshot: Snapshot, agents: Sequence[str], restart_only: Collection[str]) -> Resubmissions:
    """The restored continuations a restore of `snapshot` must discard (`known`), and the agents
    for which that cannot be read (`unknown`, refusing the restore: `discard_plan`).

    A continuation cannot continue after a restore when it depends on a `restart_only`
    resources server: that server comes back empty, while the saved turn expects the state it had.
    Only an agent that declares both `discard_restored_continuation_v1` and
    `agent_resource_dependency_index_v1` can drop one (`can_discard`; `agents` names those, in
    order). For each of them (none when the cluster has no `restart_only` resources server), each
    row of its committed continuation index (the snapshot's `continuation_index` of it, checked
    against its sha256) whose `resource_state_revisions` names one of `restart_only` — or is
    null, an index that does not say — is discarded as execution (rollout_id, attempt_index + 1),
    the attempt its `/run` then starts from the task. Sorted per agent, agents in order.
    """
    if not restart_only:
        return Resubmissions()
    chosen: list[Resubmission] = []
    unknown: list[UnknownResubmissions] = []
    folders = snapshot.folders
    for name in agents:
        ref = (snapshot.participant(name) or {}).get("continuation_index")
        folder = folders.get(name)
        try:
            index = ArtifactRef.model_validate(ref)  # relative to the agent's folder, where it committed
            data = ((snapshot.path / folder if folder else snapshot.path) / index.relative_path).read_bytes()
            if sha256_hex(data) != index.sha256:
                raise ValueError(f"{index.relative_path}: sha256 differs from the committed one")
            rows = continuation_rows(index.relative_path, data)
        except OSError as error:
            why = f"its continuation index cannot be read: {error.strerror or error}"
            unknown.append(UnknownResubmissions(name, why))
            continue
        except ValueError as error:
            unknown.append(UnknownResubmissions(name, f"its continuation index is unusable: {_first(error)}"))
            continue
        mine = {
            Resubmission(name, row.rollout_id, row.attempt_index + 1)
            for row in rows
            if row.resource_state_revisions is None or set(row.resource_state_revisions) & set(restart_only)
        }
        chosen.extend(sorted(mine, key=lambda r: (r.rollout_id, r.attempt_index)))
    return Resubmissions(tuple(chosen), tuple(unknown))


def continuation_rows(where: str, data: bytes) -> list[ContinuationRow]:
    """The rows of a continuation index `where` (its records: the non-empty lines, as an artifact
    reference counts them); `ValueError` naming the first record that is not a row (its line,
    field and problem, on one line). A save's commit check and a restore's discard plan read rows
    by this one rule."""
    rows: list[ContinuationRow] = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            rows.append(ContinuationRow.model_validate_json(line))
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(part) for part in first["loc"]) or "the row"
            raise ValueError(f"{where}:{number}: {field}: {first['msg']}") from None
    return rows


def discard_plan(snapshot: Snapshot, agents: Sequence[str], restart_only: Collection[str]) -> Resubmissions:
    """`discards`, refusing the restore (`SnapshotError`, before any server is contacted) when an
    agent that can discard has a continuation index that cannot be read: without it the restore
    cannot tell which saved turns depend on a server that comes back empty."""
    plan = discards(snapshot, agents, restart_only)
    if plan.unknown:
        problems = [f"{u.server}: {u.reason}" for u in plan.unknown]
        raise SnapshotError(
            f"snapshot {snapshot.path} cannot be restored: the cluster has restart_only resources"
            f" servers ({', '.join(sorted(restart_only))}), and which saved continuations depend on"
            " them cannot be read:\n  " + "\n  ".join(problems) + "\nNothing was restored and no"
            " server was contacted; restore a snapshot you trust",
            problems,
        )
    return plan


async def resubmissions_of(ctx: Context, attempt: Attempt) -> tuple[Resubmission, ...]:
    """What a restore that finished (here or in an earlier process) continues: `attempt.resubmit`
    when this process ran its restore phase, else read again from its snapshot (setting
    `attempt.resubmit_unknown` too); () for a save, or when the snapshot is gone or not the one
    restored (nothing can be said then). The continuations it discarded (`attempt.restart`, read
    back from its ledger) are never among them.

    Read again without digesting the whole snapshot (a resume must not wait on it): its manifest's
    sha256 must be the one the restore recorded when it began, each agent's manifest the digest
    that manifest names, each record its agent manifest's (`read_resubmissions`). A restore
    recorded before that digest was (`snapshot_sha256` None) is checked whole (`reverify`).
    """
    if attempt.kind != "restore" or attempt.resubmit or attempt.resubmit_unknown:
        return attempt.resubmit
    agents = attempt.group("agent")
    path = attempt.snapshot
    if path is None:
        return ()
    snapshot: Snapshot | None = None
    if attempt.snapshot_sha256 is None:
        whole = await reverify(ctx, attempt)
        snapshot = None if isinstance(whole, str) else whole
    else:
        recorded = attempt.snapshot_sha256
        try:
            snapshot = await anyio.to_thread.run_sync(_same_agents, path, recorded, agents)
        except (SnapshotError, OSError):
            snapshot = None
    if snapshot is None:
        return ()
    try:
        found = await anyio.to_thread.run_sync(read_resubmissions, snapshot, agents)
    except SnapshotError:
        return ()
    _settle(attempt, found)
    return attempt.resubmit


def _settle(attempt: Attempt, found: Resubmissions) -> None:
    """Set what a restore continues from what its snapshot says, less what it discarded."""
    restarted = set(attempt.restart)
    attempt.resubmit = tuple(r for r in found.known if r not in restarted)
    attempt.resubmit_unknown = found.unknown


def _same_agents(path: Path, manifest_sha256: str, agents: Sequence[Member]) -> Snapshot | None:
    """The snapshot at `path` when its manifest has `manifest_sha256` and each agent's manifest the
    digest it names (`manifest_digest`), else None."""
    snapshot = load_snapshot(path)
    if file_digest(snapshot.manifest_file)[1] != manifest_sha256:
        return None
    for member in agents:
        entry = snapshot.participant(member.name) or {}
        own = entry.get("manifest")
        if not isinstance(own, str) or file_digest(path / own)[1] != entry.get("manifest_digest"):
            return None
    return snapshot


def _first(error: ValueError) -> str:
    """The first line of a parse error (pydantic's are long)."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


async def restore_body(
    ctx: Context, attempt: Attempt, snapshot: Snapshot, *, only: Collection[str] | None = None
) -> dict[str, Any]:
    """The restore phase: policy → agents → resources, each reply checked against the snapshot.

    `only`: restore just these participants (in the same order) — servers found restarted since
    the restore (`reinstate`). One of them that answers 409 `stale_checkpoint` has retired this id:
    it was resumed under it already (a resume whose reply was lost), so it runs the restored state
    and counts as resumed (`Attempt.resumed`), not as a failure.
    """
    phase = "restore"
    source = snapshot.checkpoint_id
    folders = snapshot.folders  # where each committed, as the publication recorded it

    def dir_body(m: Member) -> CheckpointDirBody:
        folder = folders.get(m.name)
        return CheckpointDirBody(
            checkpoint_id=attempt.checkpoint_id,
            deadline_ts=attempt.deadline_ts,
            checkpoint_dir=str(snapshot.path / folder) if folder else str(snapshot.path),
        )

    async def call(m: Member, request: CheckpointDirBody) -> CallResult:
        return await send_call(ctx, attempt, m, "restore", phase, body=request, expect_checkpoint=source)

    def resumed_already(m: Member, result: CallResult) -> bool:
        if only is None or not (result.status == 409 and result.code == STALE_CHECKPOINT):
            return False
        attempt.resumed.add(m.name)
        return True

    def same_index(m: Member, key: str, got: ArtifactRef | None) -> None:
        committed = (snapshot.participant(m.name) or {}).get(key)
        if committed is None and got is None:
            return
        if got is None:
            raise PhaseFailure(
                phase, m.name, f"its restore reply has no {key}, but the snapshot committed one"
            )
        keys = ("relative_path", "sha256", "records", "bytes")
        reported = got.model_dump(mode="json")
        if not isinstance(committed, dict) or any(committed.get(k) != reported.get(k) for k in keys):
            raise PhaseFailure(
                phase,
                m.name,
                f"its restored {key} differs from the one committed in the snapshot"
                f" (restored {_describe(reported)}, committed {_describe(committed)})",
            )

    async def policy(m: Member) -> dict[str, Any]:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        body = dir_body(m)
        result = await call(
            m, ModelRestoreBody.model_validate({**body.model_dump(), INCLUDE_STORAGE_REFERENCE_INDEX: True})
        )
        if resumed_already(m, result):
            return {"resumed_already": True}
        if (
            result.error == "http"
            and result.status == 422
            and INCLUDE_STORAGE_REFERENCE_INDEX in (result.detail or "")
        ):
            result = await call(m, body)  # a later Gym: no opt-in field, the index comes back anyway
        reply = expect_reply(result, ModelRestoreReply, phase, "model restore")
        same_index(m, "storage_reference_index", reply.storage_reference_index)
        return {"rollouts": reply.rollouts, "rows": reply.rows}

    async def agent(m: Member) -> dict[str, Any]:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        result = await call(m, dir_body(m))
        if resumed_already(m, result):
            return {"resumed_already": True}
        reply = expect_reply(result, AgentRestoreReply, phase, "agent restore")
        same_index(m, "continuation_index", reply.continuation_index)
        return {"records": reply.records}

    async def resources(m: Member) -> dict[str, Any]:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        result = await call(m, dir_body(m))
        if resumed_already(m, result):
            return {"resumed_already": True}
        reply = expect_reply(result, ResourcesRestoreReply, phase, "resources restore")
        return {"sessions": reply.sessions}

    def chosen(role: Role) -> tuple[Member, ...]:
        return tuple(m for m in attempt.group(role) if only is None or m.name in only)

    plan = await anyio.to_thread.run_sync(discards, snapshot, attempt.discarding, attempt.restart_only)

    async def discard(m: Member) -> list[dict[str, Any]]:
        done: list[dict[str, Any]] = []
        for r in (r for r in plan.known if r.server == m.name):
            ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
            request = DiscardContinuationBody(
                checkpoint_id=attempt.checkpoint_id,
                deadline_ts=attempt.deadline_ts,
                rollout_id=r.rollout_id,
                attempt_index=r.attempt_index,
            )
            result = await send_call(ctx, attempt, m, "discard", phase, body=request)
            reply = expect_reply(
                result, DiscardContinuationReply, phase, "discard of a restored continuation"
            )
            done.append(
                {"rollout_id": r.rollout_id, "attempt_index": r.attempt_index, "discarded": reply.discarded}
            )
        return done

    summary: dict[str, Any] = {
        "policy": await each_member(ctx, attempt, chosen("policy"), policy),
        "agents": await each_member(ctx, attempt, chosen("agent"), agent),
        "resources": await each_member(ctx, attempt, chosen("resources"), resources),
    }
    if plan.unknown:  # the caller planned it before any call: the snapshot changed since
        first = plan.unknown[0]
        raise PhaseFailure(phase, first.server, first.reason)
    losing = tuple(
        m
        for m in chosen("agent")
        if m.name not in attempt.resumed and m.name in {r.server for r in plan.known}
    )
    if losing:
        summary["discarded"] = await each_member(ctx, attempt, losing, discard)
    attempt.restart = plan.known
    return summary


def _describe(ref: Any) -> str:
    if not isinstance(ref, dict):
        return "none"
    sha = str(ref.get("sha256", ""))[:12]
    return f"{ref.get('relative_path')} sha256 {sha}… {ref.get('records')} records"


async def reverify(ctx: Context, attempt: Attempt) -> Snapshot | str:
    """The snapshot of a recorded restore, verified again — or why it cannot be used (gone,
    damaged, or not the one the restore began from).

    Checks as a first restore does, before any server is contacted: every file against the
    manifest and the participants; then the manifest itself — against the digest the restore
    recorded when it began, or (a ledger written before that was recorded) against the ledger's
    publication of it (`provenance.check_provenance`).
    """
    path = attempt.snapshot
    if path is None:
        return "the ledger names no snapshot folder"
    expected = {m.name: m.component for m in attempt.participants}
    try:
        snapshot = await anyio.to_thread.run_sync(lambda: verify_snapshot(path, participants=expected))
        await anyio.to_thread.run_sync(read_resubmissions, snapshot, attempt.group("agent"))
        if attempt.snapshot_sha256 is None:
            await check_provenance(ctx.ledger, path)
            return snapshot
        _, digest = await anyio.to_thread.run_sync(file_digest, snapshot.manifest_file)
    except SnapshotError as error:
        return f"the snapshot {path} is gone or damaged: " + ("; ".join(error.differences[:5]) or str(error))
    except OSError as error:
        return f"the snapshot {path} cannot be read: {error}"
    if digest != attempt.snapshot_sha256:
        return (
            f"the snapshot {path} changed since the restore began: its {MANIFEST} has sha256 {digest},"
            f" the restore recorded {attempt.snapshot_sha256}"
        )
    return snapshot


async def redrive(
    ctx: Context, attempt: Attempt, snapshot: Snapshot, *, only: Collection[str] | None = None
) -> str | None:
    """Run a restore's restore phase once more under its own id, from its verified snapshot
    (`reverify`) — for every participant, or `only` those (`restore_body`); None when done, else
    why not (`phase.failed` recorded).

    Servers that already restored under this id replay their recorded result (the fence's
    idempotent replay); a server still restoring is waited for. The budget is a fresh `deadline_s`,
    recorded in the run's `phase.started`. Once done, `attempt.resubmit` lists what to send again
    (`read_resubmissions`).
    """
    attempt.deadline_ts = time.time() + ctx.config.deadline_s
    recorded = await continued_recorded(ctx, attempt.checkpoint_id)
    agents = attempt.group("agent")
    found: list[Resubmissions] = []

    async def body() -> dict[str, Any]:
        summary = await restore_body(ctx, attempt, snapshot, only=only)
        try:
            found.append(await anyio.to_thread.run_sync(read_resubmissions, snapshot, agents))
        except SnapshotError as error:  # `reverify` read them; a snapshot changed since lists none
            why = "; ".join(error.differences[:3]) or str(error)
            changed = f"its saved records changed since the snapshot was verified: {why}"
            unreadable = tuple(UnknownResubmissions(m.name, changed) for m in agents)
            if not recorded:
                await _stage_continued(ctx, attempt, snapshot, (), unreadable)
        else:
            if not recorded:
                await _stage_continued(ctx, attempt, snapshot, found[0].known, found[0].unknown)
        return summary

    try:
        await run_phase(ctx, attempt, "restore", body, own_budget=True)
    except PhaseFailure as failure:
        await record_phase_failed(
            ctx, attempt.checkpoint_id, "restore", failure.server, failure.reason, failure.code
        )
        return f"re-driving the restore failed at {failure.server}: {failure.reason}"
    attempt.state = "restored"
    if found:
        _settle(attempt, found[0])
    else:
        attempt.resubmit = ()
    return None


async def continued_recorded(ctx: Context, checkpoint_id: str) -> bool:
    """Whether the ledger holds a `rollouts.continued` of this restore (read, not remembered: a
    restore phase may have completed in an earlier process)."""
    events = ctx.ledger.read(checkpoint_id=checkpoint_id, kinds=["rollouts.continued"])
    try:
        async for _ in events:
            return True
    finally:
        close = getattr(events, "aclose", None)  # an async generator: its query ends now
        if close is not None:
            await close()
    return False


def continued_record(
    attempt: Attempt,
    snapshot: Snapshot,
    known: Sequence[Resubmission],
    unknown: Sequence[UnknownResubmissions],
) -> dict[str, Any]:
    """The `rollouts.continued` payload of a restore whose restore phase succeeded: each agent of
    the restore under `continued` (the executions it continues: `known` less the continuations
    it discarded, `attempt.restart` — what `attempt.resubmit` lists; possibly none) or, when its
    folder does not say, under `unknown` with the reason; `discarded` lists `attempt.restart` by
    agent. Each execution is `{rollout_id, attempt}`, the attempt its `/run` is sent as (n+1)."""
    restarted = set(attempt.restart)
    reasons = {u.server: u.reason for u in unknown}
    continued: dict[str, list[dict[str, Any]]] = {
        m.name: [] for m in attempt.group("agent") if m.name not in reasons
    }
    for r in known:
        if r not in restarted:
            continued.setdefault(r.server, []).append(_execution(r))
    discarded: dict[str, list[dict[str, Any]]] = {}
    for r in attempt.restart:
        discarded.setdefault(r.server, []).append(_execution(r))
    return {
        "source_checkpoint_id": snapshot.checkpoint_id,
        "continued": continued,
        "discarded": discarded,
        "unknown": reasons,
    }


def _execution(r: Resubmission) -> dict[str, Any]:
    """An execution as the `rollouts.*` events name it."""
    return {"rollout_id": r.rollout_id, "attempt": r.attempt_index}


async def _stage_continued(
    ctx: Context,
    attempt: Attempt,
    snapshot: Snapshot,
    known: Sequence[Resubmission],
    unknown: Sequence[UnknownResubmissions],
) -> None:
    """Stage `rollouts.continued` (`continued_record`) as the restore phase's last record before
    its `phase.completed`: committed no later than it, so before any server is resumed (a
    resume's first request is an append)."""
    await ctx.ledger.stage(
        "rollouts.continued",
        checkpoint_id=attempt.checkpoint_id,
        data=continued_record(attempt, snapshot, known, unknown),
    )


async def reinstate(ctx: Context, attempt: Attempt) -> None:
    """Before the servers of a restore are resumed: every participant not yet resumed under its id
    (`Attempt.resumed`) must still hold it.

    A participant whose fence holds nothing (`idle`, no checkpoint active) restarted since the
    restore: a fresh process without the snapshot's state. A resume would run it empty — Gym's
    agent and resources servers accept a resume from `idle`, a model answers 409 `invalid_phase`
    — while the others run the restored state. So such servers are restored again under the same
    id, from the snapshot verified again (`reverify`), before any server is resumed; they are
    named in `Attempt.restored_again`. Fences are read (recorded, phase `resume`) with the budget
    `max(deadline_ts, now + control_timeout_s)`; a server that cannot be read is left to its
    resume. Raises `PhaseError` — nothing resumed, the attempt left open for the same id's resume —
    when the snapshot is gone, damaged or changed, or the restore fails again.
    """
    cid = attempt.checkpoint_id
    budget = recovery_budget(ctx, attempt)
    empty: set[str] = set()

    async def read(m: Member) -> None:
        result = await ctx.caller.capabilities(
            m.name, m.url, deadline_ts=budget, phase="resume", checkpoint_id=cid
        )
        caps = result.reply
        if isinstance(caps, Capabilities) and caps.phase == "idle" and caps.active_checkpoint_id is None:
            empty.add(m.name)

    with anyio.CancelScope(deadline=anyio_deadline(budget)):
        async with anyio.create_task_group() as tg:
            for m in attempt.participants:
                if m.name not in attempt.resumed:
                    tg.start_soon(read, m)
    if not empty:
        return
    lost = [name for name in attempt.names if name in empty]
    snapshot = await reverify(ctx, attempt)
    problem: str | None
    if isinstance(snapshot, str):
        problem = snapshot
        why = f"{', '.join(lost)} restarted since the restore; {problem}"
        await record_phase_failed(ctx, cid, "resume", lost[0], why, None)
    else:
        problem = await redrive(ctx, attempt, snapshot, only=lost)
    if problem is not None:
        raise PhaseError(
            f"resume of {cid} stopped before any server was resumed: {', '.join(lost)} restarted since"
            f" the restore (its fence holds nothing of {cid}: a fresh process without the snapshot's"
            f" state), and restoring it again failed: {problem}. Resuming it would run it empty beside"
            " servers that run the restored state, so every server stays paused. Fix that (the snapshot"
            f" must be the one the restore began from) and run `{free_command(ctx, 'resume', cid)}`"
            " again, or restart every server and restore a snapshot anew.",
            phase="resume",
            server=lost[0],
            reason=f"restarted since the restore; restoring it again failed: {problem}",
            checkpoint_id=cid,
            not_resumed=[n for n in attempt.names if n not in attempt.resumed],
        )
    attempt.restored_again = tuple(name for name in lost if name not in attempt.resumed)
