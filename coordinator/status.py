"""What holds each Gym server, and the command that frees it: `quiesce status`, `Coordinator.status()`,
and the refusal of a new attempt while a participant is held.

A server is *held* when
- its fence, as its capabilities report it, is not idle (a phase other than `idle`, or an active
  checkpoint id): the holder is that id; or
- it is an agent or resources server whose fence is idle but an unfinished attempt of the ledger
  may hold it (`readback.unfinished`, `Recorded.paused`): their fence does not show everything —
  an agent whose prepare it refused (`agent_prepare_incomplete`) is back at `idle` with its
  admission still closed, and a dead coordinator's rollback may have stopped right before it.
  The holder is that attempt (its command finishes the attempt; a server it already let go only
  replays its resume). A model's fence shows every hold: its pause keeps the id active until a
  resume retires it.

The holder is looked up in the ledger:
- an attempt of this ledger: its kind, its state, and since when (the first request of it that
  server received, else the attempt's start);
- no attempt of this ledger: another ledger's (ids are unique across ledgers, `quiesce.coordinator.ids`),
  or one whose records were lost — kind `unknown`.

What frees it (`Holder.frees`, one exact command line; `Coordinator.resume(id)` / `abort(id)`
embedded): `quiesce abort --config C ID` for a save still before publication (it is rolled
back); `quiesce resume --config C ID` for everything else — a published save's unfinished resume,
a restore left paused or interrupted (finished from its snapshot first, then resumed), a rollback
or a failed restore that left servers paused, another ledger's id. Each of these commands, run
once the cause is fixed (a server unreachable, a wrong token), leaves that server idle: no state
exists that no command can leave. While a `quiesce serve` holds the ledger, such a command would
find it taken, so it goes through the service: `quiesce resume --service URL ID` (its address, from
its lease or its process: `lease.ledger_writer`; `URL` when it cannot be told).

A server's own deadline is shown (`deadline_left_s`) only while it still bounds something: not once
its holder can only end by its command (a restore left paused, a published save, a rollback that
left it paused: `Holder.deadline_applies`), nor for a server resting after a restore past it.

On Gym's unified plane (v2) a server's status shows every hold itself (its phase and active
checkpoint id; a resume clears both), so no hidden hold is inferred from the ledger; its lease
expiry and blocker count are shown, and a published stop-checkpoint is named as such (its servers
stay paused for shutdown: a restore into fresh servers is the way on).

Reading the status changes nothing and records nothing: `quiesce status` opens the ledger
read-only and takes no epoch, so it never fences a coordinator at work.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.to_thread

from quiesce.coordinator.attempt import command_line
from quiesce.coordinator.calls import CallResult
from quiesce.coordinator.config import ClusterConfig
from quiesce.coordinator.errors import ServersHeld
from quiesce.coordinator.lease import ledger_writer
from quiesce.coordinator.protocol import MODEL, Capabilities
from quiesce.coordinator.protocol_v2 import StatusReply
from quiesce.coordinator.readback import Recorded, publication_on_disk, read_attempt, unfinished
from quiesce.ledger import Ledger

__all__ = [
    "ClusterStatus",
    "Holder",
    "Peek",
    "ServerStatus",
    "deadline_left",
    "describe_holder",
    "read_status",
    "refuse_if_held",
    "status_from",
]

#: Reads one server's capabilities: (name, url, deadline_ts) → the call's result.
Peek = Callable[[str, str, float], Awaitable[CallResult]]
#: What a server's discovery route answered: v1 capabilities, or the unified plane's status.
Fence = Capabilities | StatusReply

HolderKind = Literal["save", "restore", "unknown"]

#: Fence phases a server rests in after a restore: paused until a resume, whatever the time.
_AFTER_RESTORE = frozenset({"restored_paused", "restore_failed_paused"})


@dataclass(frozen=True)
class Holder:
    """A checkpoint id that holds servers, as this ledger knows it."""

    checkpoint_id: str
    kind: HolderKind
    state: str
    started_at: str | None
    verb: Literal["resume", "abort"]
    frees: str
    #: nothing left to do for it by the ledger (recovery leaves it alone): only its command frees it
    finished: bool = True
    #: whether its deadline still bounds it: a save before publication, a restore whose restore
    #: phase has not ended, an id this ledger does not know. False once only its command ends it.
    deadline_applies: bool = True

    @property
    def recorded(self) -> bool:
        """Whether this ledger has the attempt."""
        return self.kind != "unknown"

    def as_json(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "kind": self.kind,
            "state": self.state,
            "started_at": self.started_at,
            "finished": self.finished,
            "frees": self.frees,
        }


@dataclass(frozen=True)
class ServerStatus:
    """One configured server, live: its fence, and what holds it (if anything).

    `held_by` is the checkpoint id that holds it — its fence's active id, or an unfinished
    attempt of the ledger (module docstring); `since` is when that holder's first request
    reached it, from the ledger (else the holder's start); `deadline_left_s` is the server's own
    `deadline_ts` minus now (negative: passed), None when it has none or it no longer applies
    (`deadline_left`).
    """

    name: str
    url: str
    reachable: bool
    phase: str | None = None
    active_checkpoint_id: str | None = None
    held_by: str | None = None
    since: str | None = None
    deadline_left_s: float | None = None
    holder: Holder | None = None
    error: str | None = None
    #: the capabilities read (None when unreachable, or a unified-plane server)
    capabilities: Capabilities | None = field(default=None, repr=False, compare=False)
    #: the control plane it speaks; on the unified plane (v2) its kind, lease and blocker count
    plane: str = "v1"
    kind: str | None = None
    lease_expires_at: float | None = None
    blocker_count: int | None = None

    @property
    def held(self) -> bool:
        return self.reachable and (self.held_by is not None or self.phase not in (None, "idle"))

    @property
    def holder_kind(self) -> str | None:
        return self.holder.kind if self.holder is not None else None

    @property
    def frees(self) -> str | None:
        """The exact command that frees this server (None when it is not held)."""
        return self.holder.frees if self.holder is not None and self.held else None

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "reachable": self.reachable,
            "phase": self.phase,
            "active_checkpoint_id": self.active_checkpoint_id,
            "held": self.held,
            "held_by": self.held_by,
            "holder_kind": self.holder_kind,
            "since": self.since,
            "deadline_left_s": self.deadline_left_s,
            "frees": self.frees,
            "error": self.error,
            "plane": self.plane,
            **(
                {
                    "kind": self.kind,
                    "lease_expires_at": self.lease_expires_at,
                    "blocker_count": self.blocker_count,
                }
                if self.plane == "v2"
                else {}
            ),
        }


@dataclass(frozen=True)
class ClusterStatus:
    """Every configured server, in config order. `idle`: every one reachable and not held.
    `unfinished`: the ledger's unfinished attempts (what `quiesce recover` would act on), whether
    or not they hold a server."""

    servers: tuple[ServerStatus, ...]
    unfinished: tuple[str, ...] = ()

    @property
    def held(self) -> bool:
        return any(s.held for s in self.servers)

    @property
    def idle(self) -> bool:
        return all(s.reachable and not s.held for s in self.servers)

    @property
    def holders(self) -> list[Holder]:
        """Each holder once, in the order of the first server it holds."""
        found: dict[str, Holder] = {}
        for server in self.servers:
            if server.held and server.holder is not None:
                found.setdefault(server.holder.checkpoint_id, server.holder)
        return list(found.values())

    def server(self, name: str) -> ServerStatus | None:
        return next((s for s in self.servers if s.name == name), None)

    def held_by(self, checkpoint_id: str) -> list[str]:
        """The servers `checkpoint_id` holds."""
        return [s.name for s in self.servers if s.held and s.held_by == checkpoint_id]

    def as_json(self) -> dict[str, Any]:
        """The `quiesce status --json` document."""
        return {
            "idle": self.idle,
            "held": self.held,
            "servers": [s.as_json() for s in self.servers],
            "holders": [h.as_json() for h in self.holders],
            "unfinished": list(self.unfinished),
        }


def describe_holder(
    recorded: Recorded | None, checkpoint_id: str, config_path: str | None, *, via: str | None = None
) -> Holder:
    """What `checkpoint_id` is, by the ledger (`recorded`; None: no attempt of this ledger), and the
    command that frees what it holds (see the module docstring) — through the `quiesce serve` at
    `via` when one holds the ledger. Reads the filesystem for an unfinished save's publication."""
    if recorded is None:
        return Holder(
            checkpoint_id,
            "unknown",
            "not an attempt of this ledger (another ledger's, or its records were lost)",
            None,
            "resume",
            command_line(config_path, "resume", checkpoint_id, service=via),
        )
    attempt = recorded.attempt
    outcome = recorded.last_outcome
    verb: Literal["resume", "abort"] = "resume"
    applies = False
    if attempt.kind == "save":
        if attempt.stop and outcome == "published":
            state = (
                "published as a stop-checkpoint: its servers stay paused for shutdown — restore it into"
                " freshly started servers to go on (resuming runs them as they are)"
            )
        elif outcome is None and publication_on_disk(recorded) is not None:
            state = "published; its resume did not finish"
        elif outcome is None:
            state, verb, applies = "in progress, or interrupted before publication", "abort", True
        elif outcome == "aborted":
            state = "rolled back, but servers were left paused"
        else:
            state = f"{outcome} by its records"
    elif outcome is None:
        applies = not recorded.restore_done
        state = (
            "restored; its resume did not finish"
            if recorded.restore_done
            else "restore in progress or interrupted (resuming finishes it from its snapshot first)"
        )
    elif outcome == "restored":
        state = (
            "restored; its resume did not finish"
            if recorded.resume_begun
            else "restored, waiting for its resume"
        )
    elif outcome in ("aborted", "abandoned"):
        state = f"restore {outcome}: half-restored state kept paused (resuming runs it as it is)"
    else:
        state = f"{outcome} by its records"
    return Holder(
        checkpoint_id,
        attempt.kind,
        state,
        recorded.started_at or None,
        verb,
        command_line(config_path, verb, checkpoint_id, service=via),
        recorded.finished,
        applies,
    )


def deadline_left(
    phase: str | None, deadline_ts: float | None, holder: Holder | None, now: float
) -> float | None:
    """A server's own deadline minus `now`, or None when it has none or it no longer applies: its
    holder can only end by its command now (`Holder.deadline_applies`), or the server rests after a
    restore (paused until a resume, whatever the time) and the deadline has passed."""
    if deadline_ts is None or (holder is not None and not holder.deadline_applies):
        return None
    left = deadline_ts - now
    return None if phase in _AFTER_RESTORE and left <= 0 else left


async def read_status(
    config: ClusterConfig,
    ledger: Ledger | None,
    peek: Peek,
    *,
    config_path: str | None = None,
    names: Sequence[str] | None = None,
    via: str | None = None,
    peek_v2: Peek | None = None,
) -> ClusterStatus:
    """Read every configured server's capabilities (or only `names`) concurrently, within
    `control_timeout_s`, and name what holds each held one (`ledger` None: no ledger to ask).

    `via`: the address of the `quiesce serve` that holds the ledger (a service reading its own
    status). Given a read-only `ledger` and no `via` (`quiesce status`), whether a service holds the
    ledger is found out (`lease.ledger_writer`), so every command named goes through it."""
    if via is None and ledger is not None and ledger.readonly:
        writer = await ledger_writer(config.ledger, ledger)
        via = writer.via if writer is not None else None
    deadline = time.time() + config.control_timeout_s
    servers = [s for s in config.servers if names is None or s.name in names]
    results: dict[str, CallResult] = {}

    async def one(name: str, url: str) -> None:
        results[name] = await peek(name, url, deadline)
        if peek_v2 is not None and results[name].error == "http" and results[name].status == 404:
            results[name] = await peek_v2(name, url, deadline)  # a server of Gym's unified plane

    async with anyio.create_task_group() as tg:
        for server in servers:
            tg.start_soon(one, server.name, server.url)
    found: dict[str, Fence | str] = {}
    for server in servers:
        result = results[server.name]
        reply = result.reply
        found[server.name] = (
            reply if result.ok and isinstance(reply, Capabilities | StatusReply) else result.describe()
        )
    return await status_from(config, ledger, found, config_path=config_path, via=via)


async def status_from(
    config: ClusterConfig,
    ledger: Ledger | None,
    found: Mapping[str, Fence | str],
    *,
    config_path: str | None = None,
    via: str | None = None,
) -> ClusterStatus:
    """The status of the servers in `found` (name → capabilities already read, or why they could
    not be), holders named from `ledger` (module docstring), their commands through the service at
    `via` if given. Config order."""
    holding: dict[str, str] = {}  # server -> the id that holds it
    for name, caps in found.items():
        if isinstance(caps, Capabilities) and caps.active_checkpoint_id is not None:
            holding[name] = caps.active_checkpoint_id
        elif isinstance(caps, StatusReply) and caps.checkpoint_id is not None:
            holding[name] = caps.checkpoint_id  # the unified plane shows every hold
    attempts: dict[str, Recorded | None] = {}
    pending = await unfinished(ledger, config) if ledger is not None else []
    if pending:
        for recorded in pending:
            cid = recorded.attempt.checkpoint_id
            attempts[cid] = recorded
            for name in recorded.paused:
                fence = found.get(name)
                if not isinstance(fence, Capabilities) or name in holding or fence.phase != "idle":
                    continue
                if fence.component != MODEL:  # a model's pause keeps its id active until resumed
                    holding[name] = cid
    for cid in dict.fromkeys(holding.values()):
        if cid not in attempts:
            attempts[cid] = await read_attempt(ledger, config, cid) if ledger is not None else None

    def describe(recorded: Recorded | None, cid: str) -> Holder:
        return describe_holder(recorded, cid, config_path, via=via)

    holders = {
        cid: await anyio.to_thread.run_sync(describe, recorded, cid)
        for cid, recorded in attempts.items()
        if cid in holding.values()
    }
    now = time.time()
    out: list[ServerStatus] = []
    for server in config.servers:
        reply = found.get(server.name)
        if reply is None:
            continue
        if isinstance(reply, str):
            out.append(ServerStatus(server.name, server.url, False, error=reply))
            continue
        held_by = holding.get(server.name)
        since: str | None = None
        holding_attempt = attempts.get(held_by) if held_by is not None else None
        if holding_attempt is not None:
            since = holding_attempt.first_post.get(server.name) or holding_attempt.started_at or None
        holder = holders.get(held_by) if held_by is not None else None
        if isinstance(reply, StatusReply):
            out.append(
                ServerStatus(
                    server.name,
                    server.url,
                    True,
                    phase=reply.phase,
                    active_checkpoint_id=reply.checkpoint_id,
                    held_by=held_by,
                    since=since,
                    holder=holder,
                    plane="v2",
                    kind=reply.kind,
                    lease_expires_at=reply.lease_expires_at,
                    blocker_count=reply.report.blocker_count,
                )
            )
            continue
        out.append(
            ServerStatus(
                server.name,
                server.url,
                True,
                phase=reply.phase,
                active_checkpoint_id=reply.active_checkpoint_id,
                held_by=held_by,
                since=since,
                deadline_left_s=deadline_left(reply.phase, reply.deadline_ts, holder, now),
                holder=holder,
                capabilities=reply,
            )
        )
    return ClusterStatus(tuple(out), tuple(r.attempt.checkpoint_id for r in pending))


def refuse_if_held(status: ClusterStatus, participants: Iterable[str], what: str) -> None:
    """Raise `ServersHeld` when a participant is held — before the attempt sends anything.

    The message names, per holder, the servers it holds, its kind and state, since when (the
    earliest request of it those servers received), and the command that frees them.
    """
    wanted = set(participants)
    held = {s.name: s for s in status.servers if s.name in wanted and s.held}
    if not held:
        return
    parts: list[str] = []
    for cid in dict.fromkeys(s.held_by for s in held.values()):
        mine = [s for s in held.values() if s.held_by == cid]
        names = ", ".join(s.name for s in mine)
        one = len(mine) == 1
        holder = mine[0].holder
        if cid is None or holder is None:
            verb = "reports" if one else "report"
            parts.append(f"{names} {verb} a fence that is not idle, with no checkpoint id")
            continue
        when = min((s.since for s in mine if s.since), default=holder.started_at)
        parts.append(
            f"{names} {'is' if one else 'are'} held by checkpoint {cid}"
            f" ({holder.kind}: {holder.state}{f'; since {when}' if when else ''});"
            f" free {'it' if one else 'them'} with `{holder.frees}`"
            f" (embedded: `await coord.{holder.verb}({cid!r})`)"
        )
    raise ServersHeld(
        f"cannot {what}: " + ". ".join(parts) + ". Nothing was sent.",
        {name: s.held_by or "" for name, s in held.items()},
    )
