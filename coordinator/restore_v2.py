"""A restore on Gym's unified plane (v2): every participant at once, all or nothing.

Rules:
- A restore has a new id (Gym's participants refuse a resumed id, and the source checkpoint id is
  read from each participant's manifest); `attempt.started` records the snapshot and the plane.
- The inventory is every episode the snapshot's participants exported (their commit replies'
  `episode_ids`, recorded in the snapshot's manifest); every participant gets the same one.
- Each reply is checked: `source_checkpoint_id` is the snapshot's id, and `restored` is exactly
  the next attempts of what that participant exported. The episodes restored are recorded
  (`episodes.restored`); the trainer starts each replacement attempt (`Attempt.resubmit`, from the
  environment servers — or, without one, the agents) once the servers resume.
- **All or nothing**: on any failure the next attempts of the inventory are retired everywhere
  (environment → agent → model and resources), then everyone is resumed, with a cleanup deadline
  of max(deadline, now + 30 s); `attempt.aborted` records it and the error says exactly that —
  nothing restored runs, and the servers need a fresh start before another restore.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Final

import anyio

from quiesce.coordinator.attempt import (
    Attempt,
    Context,
    PhaseFailure,
    Progress,
    Resubmission,
    expect_reply,
    next_checkpoint_id,
    record_phase_failed,
    run_phase,
    send_call,
)
from quiesce.coordinator.calls import encode_body
from quiesce.coordinator.discovery import Discovery, Member
from quiesce.coordinator.errors import DeadlineExceeded, FencedError, PhaseError, SnapshotError
from quiesce.coordinator.protocol_v2 import (
    EpisodeId,
    RestoreReply,
    RestoreRequest,
    episode_of_key,
    unique_episodes,
)
from quiesce.coordinator.publish import Snapshot, load_snapshot, read_latest
from quiesce.coordinator.resume import resume_members
from quiesce.coordinator.retire import retire

#: The least time a failed restore's cleanup gets (Gym's coordination gives it 30 s too).
CLEANUP_S: Final = 30.0


def exported_by(snapshot: Snapshot) -> dict[str, list[str]]:
    """Each participant's exported capture keys, as its commit reply gave them (the snapshot's manifest)."""
    out: dict[str, list[str]] = {}
    for entry in snapshot.participants:
        reply = entry.get("reply")
        keys = reply.get("episode_ids") if isinstance(reply, dict) else None
        if isinstance(keys, list):
            out[str(entry.get("name"))] = [str(k) for k in keys]
    return out


def inventory(snapshot: Snapshot) -> list[EpisodeId]:
    """Every episode the snapshot's participants exported, sorted (ValueError: a key names none)."""
    return unique_episodes(episode_of_key(k) for keys in exported_by(snapshot).values() for k in keys)


def replacements(attempt: Attempt) -> tuple[Resubmission, ...]:
    """The attempts the trainer starts after the resume: what the environment servers restored —
    or, in a cluster without one, the agents."""
    kinds = ("environment",) if attempt.group("environment") else ("agent",)
    out: list[Resubmission] = []
    for m in attempt.participants:
        if m.component in kinds:
            for key in attempt.restored.get(m.name, ()):
                episode = episode_of_key(key)
                out.append(Resubmission(m.name, episode.rollout_id, episode.attempt))
    return tuple(sorted(out, key=lambda r: (r.server, r.rollout_id, r.attempt_index)))


async def restore(
    ctx: Context,
    discovery: Discovery,
    snapshot: Snapshot,
    *,
    deadline_s: float | None = None,
    warnings: Sequence[str] = (),
    resume: bool = False,
    manifest_sha256: str | None = None,
) -> Attempt:
    """Restore a verified snapshot (module docstring); the servers stay `restored` (paused) until
    the caller resumes them — or, with `resume`, the caller resumes next and `attempt.started`
    says so for recovery."""
    scope = inventory(snapshot)
    checkpoint_id = await next_checkpoint_id(ctx.ledger)
    deadline_ts = time.time() + (deadline_s if deadline_s is not None else ctx.config.deadline_s)
    attempt = Attempt(
        checkpoint_id=checkpoint_id,
        kind="restore",
        deadline_ts=deadline_ts,
        participants=discovery.participants,
        snapshot=snapshot.path,
        source_checkpoint_id=snapshot.checkpoint_id,
        snapshot_sha256=manifest_sha256,
        warnings=list(warnings),
        scope=tuple(e.capture_key for e in scope),
    )
    await ctx.ledger.stage(
        "attempt.started",
        checkpoint_id=checkpoint_id,
        data={
            "kind": "restore",
            "plane": "v2",
            "deadline_ts": deadline_ts,
            "participants": attempt.names,
            "snapshot_dir": str(snapshot.path),
            "source_checkpoint_id": snapshot.checkpoint_id,
            **({"manifest_sha256": manifest_sha256} if manifest_sha256 else {}),
            **({"warnings": list(warnings)} if warnings else {}),
            **({"resume": True} if resume else {}),
        },
        durable=True,
    )
    try:
        await run_phase(ctx, attempt, "restore", lambda: _restore_body(ctx, attempt, snapshot, scope))
    except FencedError:
        raise
    except PhaseFailure as failure:
        with anyio.CancelScope(shield=True):
            raise await clean_up(ctx, attempt, scope, failure) from None
    except BaseException as exc:  # cancelled, or a bug: clean up the same way, then re-raise
        with anyio.CancelScope(shield=True):
            interrupted = PhaseFailure("restore", None, f"interrupted by {type(exc).__name__}: {exc}")
            exc.add_note(str(await clean_up(ctx, attempt, scope, interrupted)))
        raise
    await ctx.ledger.stage(
        "episodes.restored",
        checkpoint_id=checkpoint_id,
        data={
            "source_checkpoint_id": snapshot.checkpoint_id,
            "scope": list(attempt.scope),
            "restored": {n: list(k) for n, k in attempt.restored.items()},
        },
    )
    if not resume:  # explicitly left paused for the caller: terminal now
        await ctx.ledger.append(
            "attempt.completed",
            checkpoint_id=checkpoint_id,
            data={"servers": attempt.touched, "outcome": "restored"},
        )
    attempt.state = "restored"
    attempt.resubmit = replacements(attempt)
    return attempt


async def _restore_body(
    ctx: Context, attempt: Attempt, snapshot: Snapshot, scope: list[EpisodeId]
) -> dict[str, Any]:
    phase = "restore"
    exported = exported_by(snapshot)
    folders = snapshot.folders  # as the publication recorded them
    bodies: dict[str, Any] = {}
    for folder in set(folders.values()) | {""}:  # the same request to every server of a folder
        bodies[folder] = encode_body(
            RestoreRequest(
                checkpoint_id=attempt.checkpoint_id,
                deadline_ts=attempt.deadline_ts,
                checkpoint_dir=str(snapshot.path / folder) if folder else str(snapshot.path),
                episode_ids=scope,
            )
        )

    async def one(m: Member) -> None:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        result = await send_call(ctx, attempt, m, "restore", phase, body=bodies[folders.get(m.name, "")])
        try:
            reply = expect_reply(result, RestoreReply, phase, "restore")
            if reply.source_checkpoint_id != snapshot.checkpoint_id:
                raise PhaseFailure(
                    phase,
                    m.name,
                    f"it restored checkpoint {reply.source_checkpoint_id!r}, not the snapshot's"
                    f" {snapshot.checkpoint_id!r}",
                )
            expected = sorted(episode_of_key(k).next_attempt().capture_key for k in exported.get(m.name, []))
            if sorted(reply.restored) != expected:
                missing = sorted(set(expected) - set(reply.restored))
                extra = sorted(set(reply.restored) - set(expected))
                raise PhaseFailure(
                    phase,
                    m.name,
                    "its restored attempts are not the next attempts of what it saved"
                    + (f"; missing {', '.join(missing[:5])}" if missing else "")
                    + (f"; unexpected {', '.join(extra[:5])}" if extra else ""),
                )
            attempt.restored[m.name] = tuple(sorted(reply.restored))
        except PhaseFailure as failure:
            attempt.settled[m.name] = failure

    async with anyio.create_task_group() as tg:
        for m in attempt.participants:
            tg.start_soon(one, m)
    failed = [attempt.settled[m.name] for m in attempt.participants if m.name in attempt.settled]
    if failed:
        raise failed[0].with_others(failed[1:])
    return {"restored": {n: len(k) for n, k in attempt.restored.items()}, "scope": len(scope)}


def recorded_inventory(attempt: Attempt) -> list[EpisodeId]:
    """The inventory of a restore read back from the ledger: its snapshot's, while the snapshot can
    be read; else what `episodes.restored` recorded; else nothing."""
    if attempt.snapshot is not None:
        try:
            return inventory(load_snapshot(attempt.snapshot))
        except (SnapshotError, OSError, ValueError):
            pass
    return unique_episodes(episode_of_key(k) for k in attempt.scope)


async def abandon(ctx: Context, attempt: Attempt, reason: str) -> PhaseError:
    """Clean up a restore that did not finish (its coordinator died, or a caller lets it go): the
    same cleanup as a failed restore, with the inventory read back (`recorded_inventory`)."""
    return await clean_up(ctx, attempt, recorded_inventory(attempt), PhaseFailure("restore", None, reason))


async def clean_up(
    ctx: Context, attempt: Attempt, scope: Sequence[EpisodeId], failure: PhaseFailure
) -> PhaseError:
    """Retire the next attempts of `scope` everywhere, resume everyone, record `attempt.aborted`;
    return the error to raise (module docstring)."""
    cid = attempt.checkpoint_id
    await record_phase_failed(ctx, cid, "restore", failure.server, failure.reason, failure.code)
    reason = f"restore failed at {failure.server or 'the coordinator'}: {failure.reason}"
    await ctx.ledger.stage("attempt.aborting", checkpoint_id=cid, data={"reason": reason})
    budget = max(attempt.deadline_ts, time.time() + CLEANUP_S)
    nexts = [e.next_attempt() for e in scope]
    retired_text = "nothing to retire (the snapshot holds no episode)"
    retire_failed: dict[str, str] = {}
    if nexts:
        outcome = await retire(ctx, attempt, nexts, deadline_ts=budget, reason="clean up a failed restore")
        retire_failed = outcome.failed
        retired_text = f"retired the next attempts of its {len(nexts)} episodes on every server"
        if retire_failed:
            retired_text += " but " + ", ".join(f"{n} ({why})" for n, why in retire_failed.items())
    _, resumed, not_paused, left, failures = await resume_members(
        ctx, attempt, attempt.names, phase="rollback", deadline_ts=budget
    )
    await ctx.ledger.append(
        "attempt.aborted",
        checkpoint_id=cid,
        data={"reason": reason, "resumed": resumed, "left_paused": left, "not_paused": not_paused},
    )
    attempt.state = "aborted"
    why = {n: r.describe() for n, r in failures}
    named = ", ".join(f"{n} ({why.get(n, 'no time left')})" for n in left)
    could_not = f" Could not resume {named}." if left else " Everyone is resumed."
    cls = DeadlineExceeded if failure.deadline else PhaseError
    latest = read_latest(ctx.config.snapshots)
    return cls(
        f"restore {cid} of snapshot {attempt.snapshot} failed: {reason}. Nothing restored runs: the"
        f" coordinator {retired_text} and resumed everyone it had asked.{could_not} Restart the Gym"
        " servers fresh (a restore needs servers that hold no episode) and restore again.",
        phase="restore",
        server=failure.server,
        reason=failure.reason,
        code=failure.code,
        checkpoint_id=cid,
        resumed=resumed + not_paused,
        not_resumed=left,
        latest_snapshot=str(latest) if latest else None,
        warnings=list(attempt.warnings),  # e.g. the snapshot's provenance: shown with the failure
    )
