"""Reading an attempt back from the ledger, and letting go of what it holds: what another process
(`quiesce resume | abort [ID]`, `quiesce status`) or recovery acts on.

`read_attempt` rebuilds an `Attempt` (participants, touched and refused servers, those whose resume
answered, publication, how far its restore and resume got) from events alone — components from
the discovery before it, URLs from the config. `publication_on_disk` / `settle_publication` let
the filesystem decide whether an unfinished save was published (the fsynced rename is the commit
point).
`unfinished` lists what recovery must finish; `release` lets go of what one recorded attempt holds.

An attempt is *finished* when nothing is left to do for it: it has a terminal record and, if that
record is `attempt.completed {restored}`, no resume of it has begun since (a restore left paused
for the caller is finished until the caller's resume starts; that resume is then a step like any
other, finished by recovery if its coordinator dies).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from quiesce.coordinator.attempt import (
    Attempt,
    Context,
    Outcome,
    Resubmission,
    record_phase_failed,
    recovery_budget,
    resume_sorted,
)
from quiesce.coordinator.config import ClusterConfig
from quiesce.coordinator.digests import file_digest
from quiesce.coordinator.discovery import Member
from quiesce.coordinator.errors import PhaseError, QuiesceError, SnapshotError
from quiesce.coordinator.phases import V2_ROLE_OF_KIND
from quiesce.coordinator.protocol import AGENT, MODEL, RESOURCES
from quiesce.coordinator.publish import load_snapshot, manifest_file_of, write_latest
from quiesce.coordinator.restore import redrive, resubmissions_of, reverify
from quiesce.coordinator.restore_v2 import abandon, replacements
from quiesce.coordinator.resume import finish_resume, next_step, resume_members, roll_back
from quiesce.coordinator.save import final_dir_of
from quiesce.ledger import AttemptRow, Event, Ledger

__all__ = [
    "Recorded",
    "load_attempt",
    "publication_on_disk",
    "read_attempt",
    "release",
    "settle_publication",
    "unfinished",
]


@dataclass
class Recorded:
    """What the ledger says about one attempt.

    `terminal` holds its terminal records in order (a restore may have two: restored, resumed);
    `restore_done` is true once a restore phase completed; `resume_begun` once a resume phase began
    after the last terminal record (or with none); `first_post` the time of the first request
    (not a resume) sent to each server — since when that server may be held.
    """

    attempt: Attempt
    events: list[Event]
    row: AttemptRow | None = None
    started_at: str = ""
    resume_wanted: bool = False
    publishing: dict[str, Any] | None = None
    published: dict[str, Any] | None = None
    terminal: list[Event] = field(default_factory=list)
    restore_done: bool = False
    resume_begun: bool = False
    first_post: dict[str, str] = field(default_factory=dict)

    @property
    def last_outcome(self) -> str | None:
        """The outcome of the last terminal record (`aborted` for `attempt.aborted`), or
        `abandoned` for a restore recovery gave up (recorded in `recovery.completed` only)."""
        if self.terminal:
            last = self.terminal[-1]
            if last.kind == "attempt.aborted":
                return "aborted"
            return str(last.data.get("outcome", "completed"))
        if self.row is not None and self.row.outcome == "abandoned":
            return "abandoned"
        return None

    @property
    def finished(self) -> bool:
        """Nothing left to do for it (see the module docstring); an abandoned restore is finished too."""
        outcome = self.last_outcome
        if outcome is None:
            return False
        return not (outcome == "restored" and self.resume_begun)

    @property
    def paused(self) -> list[str]:
        """Servers this attempt may have left paused, by the ledger alone (first-contact order)."""
        outcome = self.last_outcome
        if outcome == "restored":  # left paused for the caller, or its resume did not finish
            return self.attempt.names
        if outcome == "aborted":
            value = self.terminal[-1].data.get("left_paused")
            return [str(v) for v in value] if isinstance(value, list) else []
        if outcome is None or outcome == "abandoned":
            return self.attempt.may_hold
        return []


async def read_attempt(ledger: Ledger, config: ClusterConfig, checkpoint_id: str) -> Recorded | None:
    """Rebuild an attempt from its events (None when the ledger has no such attempt).

    Components come from the discovery before it; URLs from the config.
    """
    events = [ev async for ev in ledger.read(checkpoint_id=checkpoint_id)]
    started = next((ev for ev in events if ev.kind == "attempt.started"), None)
    if started is None:
        return None
    discovery = await ledger.last_before("discovery.completed", started.seq)  # O(1) in the history
    participants = discovery.data.get("participants", []) if discovery is not None else []
    discovered: dict[str, dict[str, Any]] = {str(p["name"]): p for p in participants if isinstance(p, dict)}
    members: list[Member] = []
    for name in started.data.get("participants", []):
        info = discovered.get(name, {})
        configured = config.server(name)
        component = str(info.get("component", ""))
        role = info.get("role")
        url = configured.url if configured else str(info.get("url", ""))
        if info.get("plane") == "v2" and component in V2_ROLE_OF_KIND and url:
            role_v2 = V2_ROLE_OF_KIND[component]
            policy = "policy" if role_v2 == "policy" else None
            folder = str(info.get("folder", "")) if configured is None else configured.folder or ""
            members.append(
                Member(name, component, "export_restore", policy, role_v2, url, plane="v2", folder=folder)
            )
        elif component in (MODEL, AGENT, RESOURCES) and role in ("policy", "agent", "resources") and url:
            members.append(
                Member(
                    name,
                    component,
                    str(info.get("mode", "")),
                    "policy" if role == "policy" else None,
                    role,
                    url,
                    folder=str(info.get("folder", "")),  # where it committed, as discovered then
                    reported_name=str(info.get("reported_name", "")),
                )
            )
    data = started.data
    attempt = Attempt(
        checkpoint_id=checkpoint_id,
        kind="restore" if data.get("kind") == "restore" else "save",
        deadline_ts=float(data.get("deadline_ts", 0.0)),
        participants=tuple(members),
        staging_dir=Path(data["staging_dir"]) if data.get("staging_dir") else None,
        in_place=data.get("in_place") is True,
        snapshot=Path(data["snapshot_dir"]) if data.get("snapshot_dir") else None,
        source_checkpoint_id=data.get("source_checkpoint_id"),
        snapshot_sha256=data.get("manifest_sha256") if isinstance(data.get("manifest_sha256"), str) else None,
        stop=data.get("stop") is True,
        restart_only=tuple(str(n) for n in data.get("restart_only") or ()),
        discarding=tuple(str(n) for n in data.get("discarding") or ()),
    )
    recorded = Recorded(
        attempt,
        events,
        row=await ledger.attempt(checkpoint_id),
        started_at=started.at,
        resume_wanted=data.get("resume") is True,
    )
    requests: dict[str, str] = {}  # call id -> server, for requests that are not resumes
    resumes: dict[str, str] = {}  # call id -> server, for resumes
    for ev in events:
        kind = ev.kind
        if kind == "call.sent" and ev.server is not None and ev.data.get("method") == "POST":
            attempt.touch(ev.server)
            if str(ev.data.get("path", "")).endswith("/resume"):
                resumes[ev.call_id or ""] = ev.server
            else:
                requests[ev.call_id or ""] = ev.server
                recorded.first_post.setdefault(ev.server, ev.at)
        elif kind == "call.replied" and (ev.call_id or "") in resumes:
            attempt.resumed.add(resumes[ev.call_id or ""])
        elif kind in ("call.replied", "call.failed") and (ev.call_id or "") in requests:
            status = ev.data.get("status")
            code = ev.data.get("code") if kind == "call.failed" else None
            attempt.note_outcome(
                requests[ev.call_id or ""],
                status if kind == "call.failed" and isinstance(status, int) else None,
                str(code) if isinstance(code, str) else None,
            )
        elif kind == "episodes.scoped":
            attempt.scope = tuple(str(k) for k in ev.data.get("scope", []))
            attempt.restarts = {str(n): tuple(k) for n, k in ev.data.get("restarts", {}).items()}
        elif kind == "episodes.exported":
            attempt.exported = {str(n): tuple(k) for n, k in ev.data.get("exported", {}).items()}
        elif kind == "episodes.restored":
            attempt.scope = tuple(str(k) for k in ev.data.get("scope", []))
            attempt.restored = {str(n): tuple(k) for n, k in ev.data.get("restored", {}).items()}
        elif kind == "attempt.publishing":
            recorded.publishing = ev.data
        elif kind == "attempt.published":
            recorded.published = ev.data
            attempt.snapshot = Path(ev.data["final_dir"])
        elif kind in ("attempt.completed", "attempt.aborted"):
            recorded.terminal.append(ev)
            recorded.resume_begun = False
        elif kind == "phase.completed" and ev.data.get("phase") == "restore":
            recorded.restore_done = True
            attempt.restart = _discarded(ev.data.get("summary"), attempt.restart)
        elif kind == "phase.started" and ev.data.get("phase") == "resume":
            recorded.resume_begun = True
        elif kind == "phase.started" and attempt.in_place and isinstance(ev.data.get("staging_dir"), str):
            attempt.staging_dir = Path(ev.data["staging_dir"])  # named by the commit (`save_v2.commit`)
    outcome = recorded.last_outcome
    if outcome == "aborted":
        attempt.state = "aborted"
    elif outcome == "restored" or (outcome is None and recorded.restore_done):
        attempt.state = "restored"
    elif outcome is not None:
        attempt.state = "completed"
    elif recorded.published is not None:
        attempt.state = "published"
    elif recorded.publishing is not None:
        attempt.state = "publishing"
    return recorded


async def load_attempt(ctx: Context, checkpoint_id: str) -> Recorded:
    """`read_attempt`, raising `QuiesceError` when the ledger has no such attempt."""
    recorded = await read_attempt(ctx.ledger, ctx.config, checkpoint_id)
    if recorded is None:
        raise QuiesceError(f"the ledger has no attempt {checkpoint_id}")
    return recorded


async def unfinished(ledger: Ledger, config: ClusterConfig) -> list[Recorded]:
    """Every attempt that is not finished (module docstring), in the order of their last event.

    Those without a terminal record come from the database's filter (`unfinished_attempts`); a
    restore whose resume began after `restored` can only be the ledger's latest attempt — while it
    holds the servers no other attempt may start (`status.refuse_if_held`), and recovery finishes
    it before any other — so only that one is read back. What is read grows with the unfinished
    attempts, never with the history.
    """
    rows = await ledger.unfinished_attempts()
    out = [
        r for r in [await read_attempt(ledger, config, row.checkpoint_id) for row in rows] if r is not None
    ]
    latest = await ledger.last_before("attempt.started", await ledger.last_seq() + 1)
    cid = latest.checkpoint_id if latest is not None and latest.data.get("kind") == "restore" else None
    if cid is not None and all(r.attempt.checkpoint_id != cid for r in out):
        recorded = await read_attempt(ledger, config, cid)
        if recorded is not None and not recorded.finished:
            out.append(recorded)
    out.sort(key=lambda r: r.events[-1].seq if r.events else 0)
    return [r for r in out if not r.finished]


def publication_on_disk(recorded: Recorded) -> Path | None:
    """The folder an unfinished save was published to, if the filesystem shows it was: the final
    folder (the one `attempt.publishing` names, else `final_dir_of` the staging folder
    `attempt.started` records) with a manifest naming this checkpoint id. Reads only."""
    attempt = recorded.attempt
    if recorded.published is not None:
        return Path(recorded.published["final_dir"])
    if recorded.publishing is not None:
        final = Path(recorded.publishing["final_dir"])
    elif attempt.staging_dir is not None:
        final = final_dir_of(attempt.staging_dir, in_place=attempt.in_place)
    else:
        return None
    try:
        snapshot = load_snapshot(final)
    except SnapshotError:
        return None
    return final if snapshot.checkpoint_id == attempt.checkpoint_id else None


async def settle_publication(ctx: Context, recorded: Recorded) -> bool:
    """An unfinished save without `attempt.published`: the filesystem decides whether it was published.

    Published (`publication_on_disk`) is recorded now and LATEST updated; returns whether it is
    published. The folder is looked for even when the ledger has no `attempt.publishing`: that
    record is staged, so a crash right after the rename loses it while the fsynced rename survives.
    """
    attempt = recorded.attempt
    if recorded.published is not None:
        return True
    final = await anyio.to_thread.run_sync(publication_on_disk, recorded)
    if final is None:
        return False
    _, digest = await anyio.to_thread.run_sync(file_digest, manifest_file_of(final))
    await ctx.ledger.stage(
        "attempt.published",
        checkpoint_id=attempt.checkpoint_id,
        data={"final_dir": str(final), "manifest_sha256": digest},
    )
    if not attempt.in_place:  # a folder published in place is its caller's to point at
        await anyio.to_thread.run_sync(write_latest, final.parent, final.name)
    recorded.published = {"final_dir": str(final), "manifest_sha256": digest}
    attempt.snapshot = final
    attempt.state = "published"
    return True


async def release(ctx: Context, recorded: Recorded, *, reason: str, held: Sequence[str] = ()) -> Outcome:
    """Let go of what a recorded attempt holds (`quiesce resume | abort [ID]`, from any process).

    `held` names the servers that report this checkpoint id active now (asked by the caller).
    - save without a terminal record: published (or found published on disk) → resume every
      participant (`published`); otherwise roll back (`aborted`);
    - restore without a terminal record: its restore phase is finished first if it had not
      completed (`restore.redrive`: same id, snapshot verified again) — half-restored state must
      not run — then every participant is resumed (`resumed`). Only when its snapshot is gone or
      damaged are the servers it may have touched resumed as they are: this is an explicit
      request, and the only way out but restarting them;
    - restore left paused (`restored`), or whose resume did not finish: resume every participant;
    - a restore's outcome lists what the caller must send again (`Outcome.resubmit`,
      `restore.resubmissions_of`);
    - otherwise the servers it left paused by its last record, and those in `held`, are resumed
      under its id (`resumed`); nothing paused → `none`.
    Raises `PhaseError` when a server cannot be resumed (the record allows a retry).
    """
    attempt = recorded.attempt
    outcome = recorded.last_outcome
    if outcome is None and attempt.kind == "save":
        if await settle_publication(ctx, recorded):
            return await finish_resume(ctx, attempt)
        error = await roll_back(ctx, attempt, None, reason=reason)
        return Outcome(
            attempt.checkpoint_id,
            "aborted",
            tuple(resume_sorted(attempt, attempt.touched)),
            tuple(error.resumed),
            (),
            tuple(error.not_resumed),
        )
    ours = [name for name in held if attempt.member(name) is not None]
    if attempt.plane == "v2" and attempt.kind == "restore":
        return await _release_v2_restore(ctx, recorded, reason)
    if attempt.kind == "restore" and (outcome is None or outcome == "abandoned"):
        if not recorded.restore_done:
            snapshot = await reverify(ctx, attempt)
            if isinstance(snapshot, str):  # gone or damaged: nothing to finish it from
                return await _resume_named(ctx, recorded, _union(recorded.paused, ours))
            problem = await redrive(ctx, attempt, snapshot)
            if problem is not None:
                raise PhaseError(
                    f"restore {attempt.checkpoint_id} cannot be finished: {problem}. Its servers stay"
                    " paused (half-restored state must not run). "
                    + next_step(ctx, attempt.checkpoint_id, [])
                    + " Or restart them and restore another snapshot.",
                    phase="restore",
                    server=None,
                    reason=problem,
                    checkpoint_id=attempt.checkpoint_id,
                    not_resumed=recorded.paused,
                )
        resumed = await finish_resume(ctx, attempt)
        return replace(
            resumed,
            resubmit=await resubmissions_of(ctx, attempt),
            restart=attempt.restart,
            resubmit_unknown=attempt.resubmit_unknown,
        )
    if outcome == "restored":
        resumed = await finish_resume(ctx, attempt)
        return replace(
            resumed,
            resubmit=await resubmissions_of(ctx, attempt),
            restart=attempt.restart,
            resubmit_unknown=attempt.resubmit_unknown,
        )
    return await _resume_named(ctx, recorded, _union(recorded.paused, ours))


async def _release_v2_restore(ctx: Context, recorded: Recorded, reason: str) -> Outcome:
    """A unified-plane restore: one whose restore phase finished is resumed (its replacement
    attempts listed); one that did not is cleaned up as a failed restore — next attempts retired
    everywhere, everyone resumed (`restore_v2.abandon`) — never finished half-way."""
    attempt = recorded.attempt
    if recorded.restore_done or recorded.last_outcome == "restored":
        resumed = await finish_resume(ctx, attempt)
        return replace(resumed, resubmit=replacements(attempt))
    if recorded.last_outcome is not None:
        return Outcome(attempt.checkpoint_id, "none")
    error = await abandon(ctx, attempt, f"{reason}: the restore had not finished")
    return Outcome(
        attempt.checkpoint_id,
        "aborted",
        tuple(resume_sorted(attempt, attempt.names)),
        tuple(error.resumed),
        (),
        tuple(error.not_resumed),
    )


def _union(first: Sequence[str], second: Sequence[str]) -> list[str]:
    return list(dict.fromkeys([*first, *second]))


async def _resume_named(ctx: Context, recorded: Recorded, names: list[str]) -> Outcome:
    """Resume `names` under the attempt's id (phase resume), then `attempt.completed {resumed}`."""
    attempt = recorded.attempt
    if not names:
        return Outcome(attempt.checkpoint_id, "none")
    budget = recovery_budget(ctx, attempt)
    await ctx.ledger.stage("phase.started", checkpoint_id=attempt.checkpoint_id, data={"phase": "resume"})
    called, resumed, not_paused, left, failures = await resume_members(
        ctx, attempt, names, phase="resume", deadline_ts=budget
    )
    if left:
        name = left[0]
        detail = next((r.describe() for n, r in failures if n == name), "no time left to call it")
        await record_phase_failed(ctx, attempt.checkpoint_id, "resume", name, detail, None)
        raise PhaseError(
            f"resume of {attempt.checkpoint_id} failed at {name}: {detail}. Still paused: {', '.join(left)}. "
            + next_step(ctx, attempt.checkpoint_id, [r for _, r in failures]),
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
    attempt.state = "completed"
    return Outcome(attempt.checkpoint_id, "resumed", tuple(called), tuple(resumed), tuple(not_paused), ())


def _discarded(summary: Any, before: tuple[Resubmission, ...]) -> tuple[Resubmission, ...]:
    """The continuations a restore phase discarded (`restore.restore_body`'s summary `discarded`:
    agent → `[{rollout_id, attempt_index}]`), added to those of its earlier runs."""
    found = list(before)
    discarded = summary.get("discarded") if isinstance(summary, dict) else None
    for server, entries in (discarded or {}).items() if isinstance(discarded, dict) else ():
        for entry in entries if isinstance(entries, list) else ():
            rollout = entry.get("rollout_id") if isinstance(entry, dict) else None
            index = entry.get("attempt_index") if isinstance(entry, dict) else None
            if isinstance(rollout, str) and isinstance(index, int) and not isinstance(index, bool):
                item = Resubmission(str(server), rollout, index)
                if item not in found:
                    found.append(item)
    return tuple(found)
