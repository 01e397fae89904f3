"""Reading an attempt back from the ledger: what another process (`quiesce resume | abort`) or
recovery acts on.

`load_attempt` rebuilds an `Attempt` (participants, touched servers, publication) from events
alone — components from the discovery before it, URLs from the config. `settle_publication`
lets the filesystem decide whether an unfinished save was published (the fsynced rename is the
commit point). `resume_recorded` finishes or rolls back what a recorded attempt left paused.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from coordinator.attempt import Attempt, Context, Outcome, record_phase_failed, resume_sorted
from coordinator.digests import file_digest
from coordinator.discovery import Member
from coordinator.errors import PhaseError, QuiesceError, SnapshotError
from coordinator.protocol import (
    AGENT,
    MODEL,
    RESOURCES,
)
from coordinator.publish import (
    MANIFEST,
    load_snapshot,
    write_latest,
)
from coordinator.resume import finish_resume, recovery_budget, resume_members, roll_back
from coordinator.save import final_dir_of
from ledger import Event

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
    discovery = await ctx.ledger.last_before("discovery.completed", started.seq)  # O(1) in the history
    participants = discovery.data.get("participants", []) if discovery is not None else []
    discovered: dict[str, dict[str, Any]] = {str(p["name"]): p for p in participants if isinstance(p, dict)}
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
    budget = recovery_budget(ctx, attempt)
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
