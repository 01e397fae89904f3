"""`Coordinator`: the embedded async API an RL trainer (or the CLI) drives.

    async with Coordinator.open(config) as coord:          # opens the ledger, takes an epoch
        await coord.discover()
        async with coord.save(deadline_s=60) as attempt:   # prepare + commit on entry
            write_trainer_state(attempt.staging_dir)       # the caller's own half
        # leaving the block publishes, then resumes; an exception inside rolls back and re-raises
        restored = await coord.restore(attempt.snapshot)   # servers stay paused
        await coord.resume()
        send_again(restored.resubmit)                      # the trainer's /run of each, attempt n+1

Step-wise, for an actor that calls one method per RPC: `prepare()` → `commit()` → `publish()` →
`resume()` (or `publish_and_resume()`, what leaving `save()` does), or `abort()` at any point
before publication; `restore(snapshot)` then `resume()`, then the caller sends `/run` again for
each execution of `resubmit` (Gym's restore runs none of them by itself).

Invariants:
- `open` appends `coordinator.started` with a new epoch (fencing any older coordinator) before
  anything else; every later append of an older coordinator raises `FencedError`, and this class
  never catches it: a fenced coordinator stops acting.
- One attempt at a time: a new `prepare` or `restore` while an attempt awaits its next step is
  refused (`QuiesceError`) — finish it (`resume`) or `abort` it first. And before it sends
  anything, a new `prepare` or `restore` is refused (`ServersHeld`) while a participant is held by
  another checkpoint id — by the fences discovery read, or read again when this coordinator's own
  last step may have changed them — naming the holder, its kind, since when and what frees it.
- Every control request goes through `calls.Caller` (recorded before and after).
- `resume(target)` / `abort(target)` take an `Attempt`, a checkpoint id, or None. None means the
  attempt awaiting its next step in this process, else whatever holds the servers: they are asked
  (capabilities, recorded) and every holding id is let go (`readback.release`; an id this ledger
  has no attempt of is resumed as it is). A checkpoint id works from any process.
- `status()` reads every server's fence live and names what holds it (`quiesce.coordinator.status`);
  it records nothing.
- `acknowledge_completed(server, executions)` may run at any time, an attempt in progress
  included (an agent holds finished results until acknowledged: a prepare blocked only by them
  fails at once, naming them; one still waiting for other work to park succeeds at its next retry
  once they are acknowledged); it is a recorded control call like any other.

- `open` then runs recovery (`quiesce.coordinator.recovery`) of whatever a dead coordinator left, unless
  `recover=False`; `recover()` runs it on demand. On PostgreSQL the open coordinator holds the
  lease and renews it in the background (`quiesce.coordinator.lease`); `open(standby=True)` waits to take
  it over. When a renewal finds the lease taken, every step running in this coordinator is
  stopped at once and raises `FencedError` (`LeaseGuard`), a call waiting on its reply included;
  so does every step started later. The test-only crash points
  (`quiesce.coordinator.crashpoints`) are read once, here.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

import anyio
import anyio.to_thread
from pydantic import BaseModel, ValidationError

from quiesce.coordinator import crashpoints, recovery, restore_v2, save_v2
from quiesce.coordinator import retire as retiring
from quiesce.coordinator import save as saving
from quiesce.coordinator.attempt import (
    Attempt,
    Context,
    Outcome,
    ProgressCallback,
    free_command,
    next_checkpoint_id,
    resume_sorted,
)
from quiesce.coordinator.calls import Caller, CallResult, Target, token_problem
from quiesce.coordinator.config import ClusterConfig, check_deadline, find_token, load_config, missing_token
from quiesce.coordinator.discovery import Discovery, Member, discover
from quiesce.coordinator.errors import AcknowledgementError, ConfigError, PhaseError, QuiesceError
from quiesce.coordinator.heap import frozen_step, heap_frozen
from quiesce.coordinator.http import HttpClient
from quiesce.coordinator.lease import LeaseGuard, holder_text, keep_lease
from quiesce.coordinator.phases import COMPONENT_OF_ROLE, V2_ROLE_OF_KIND
from quiesce.coordinator.preflight import preflight
from quiesce.coordinator.protocol import (
    AGENT,
    COMPLETED_RESULT_ACKNOWLEDGEMENT,
    AcknowledgeBody,
    AcknowledgeReply,
    AgentStatusReply,
    Capabilities,
    CompletionReceipt,
    CompletionReceiptReply,
    ReceiptAcknowledgeBody,
    ReceiptQuery,
    route,
)
from quiesce.coordinator.protocol_v2 import EpisodeId
from quiesce.coordinator.provenance import Provenance, check_provenance
from quiesce.coordinator.publish import (
    Snapshot,
    empty_trash,
    in_place_problem,
    in_place_roots,
    read_latest,
    resolve_snapshot,
    verify_snapshot,
)
from quiesce.coordinator.readback import read_attempt, release
from quiesce.coordinator.renewal import renew_all, renewing
from quiesce.coordinator.restore import can_discard, discard_plan, read_resubmissions
from quiesce.coordinator.restore import restore as restore_snapshot
from quiesce.coordinator.resume import finish_resume, release_unrecorded, roll_back
from quiesce.coordinator.retire import RetireOutcome
from quiesce.coordinator.status import ClusterStatus, Fence, read_status, refuse_if_held, status_from
from quiesce.coordinator.version import VERSION
from quiesce.ledger import AfterAppend, AttemptRow, Event, FencedError, LeaseTerms, Ledger, LedgerError
from quiesce.ledger.lineage import STATES, Rollout
from quiesce.ledger.rollout_refs import read_lineage_of

__all__ = ["Coordinator", "quiesce_version", "read_history"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def quiesce_version() -> str:
    """The version recorded in `coordinator.started` (a constant: no package metadata scan)."""
    return VERSION


def _as_config(config: ClusterConfig | str | os.PathLike[str]) -> ClusterConfig:
    if isinstance(config, ClusterConfig):
        if config.snapshots.is_absolute():
            return config
        return config.model_copy(update={"snapshots": config.snapshots.resolve()})
    return load_config(config)


def stops_when_fenced(
    fn: Callable[Concatenate[Coordinator, _P], Awaitable[_R]],
) -> Callable[Concatenate[Coordinator, _P], Awaitable[_R]]:
    """A step of the `Coordinator` that the loss of its lease stops at once (`LeaseGuard`): it then
    raises the ledger's `FencedError`, whatever the cancellation made of it on the way out."""

    @functools.wraps(fn)
    async def step(coord: Coordinator, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        guard = coord._lease_guard
        with guard.guard():
            try:
                return await fn(coord, *args, **kwargs)
            except Exception as error:
                if guard.error is not None and not isinstance(error, FencedError):
                    raise FencedError(str(guard.error)) from None
                raise
        assert guard.error is not None  # only the lease's loss cancels the guard's scope
        raise FencedError(str(guard.error))

    return step


class Coordinator:
    """One coordinator: one ledger writer with one epoch. Create with `Coordinator.open(...)`."""

    def __init__(self, ctx: Context, lease_guard: LeaseGuard | None = None) -> None:
        self._ctx = ctx
        #: the steps running now, stopped together when the lease is found lost
        self._lease_guard = lease_guard if lease_guard is not None else LeaseGuard()
        self._discovery: Discovery | None = None
        self._current: Attempt | None = None
        self._last_recovery: recovery.RecoveryReport | None = None
        # What is known of the servers' fences without asking them again: `_fresh`, what
        # discovery read, until this coordinator sends a request; `_clean`, this coordinator's
        # own last step left every participant idle (a save resumed, a rollback complete).
        self._fresh: Mapping[str, Fence | str] | None = None
        self._clean = False
        #: agents found to acknowledge completion receipts, not pairs (later Gym), and where
        #: each shows them: its receipt route, or its status
        self._receipt_sources: dict[str, Literal["route", "status"]] = {}

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        config: ClusterConfig | str | os.PathLike[str],
        *,
        token: str | None = None,
        on_progress: ProgressCallback | None = None,
        recover: bool = True,
        standby: bool = False,
        advertise: str | None = None,
        observe: AfterAppend | None = None,
        config_path: str | os.PathLike[str] | None = None,
        require_token: bool = True,
        client: HttpClient | None = None,
    ) -> AsyncIterator[Coordinator]:
        """Load the config (a `ClusterConfig` or a YAML path), open the ledger, take a new epoch.

        `config_path` (default: `config` when it is a path) is the file named in the commands that
        messages and `status()` tell the user to run (`quiesce resume --config FILE ID`).

        The token defaults to the environment (`config.token_env`, then the fallback variable); it
        is given to the ledger as a secret, so it is redacted from everything stored. No token is a
        `ConfigError` naming the variable to set — unless `require_token=False`: then the
        coordinator is read-only (discovery, `status()`): no Authorization header is sent, recovery
        does not run (it would resume servers), and every step that sends a request other than
        `GET /capabilities` raises that `ConfigError` before anything is recorded or sent. A token
        that cannot be a bearer token (a space, a line break, non-ASCII) is always a `ConfigError`.

        Then, unless `recover=False`, recovery runs (`quiesce.coordinator.recovery`): every attempt a dead
        coordinator left without a terminal event is finished or rolled back; its report is
        `last_recovery`. On PostgreSQL the coordinator holds the lease (`lease_s`) and renews it in
        the background; `standby=True` first waits until the current holder's lease expires, takes
        it over (ending that holder's writer session), then takes its epoch and recovers. A standby
        needs PostgreSQL: on SQLite it is a `ConfigError`. `advertise` is the address this
        coordinator serves at (`quiesce serve`), written into its lease holder for standbys; the
        commands its messages and `status()` name go through it (`quiesce resume --service URL ID`):
        while it runs, a command that opens the ledger itself would find it taken.
        `observe` is called with the events of each of this coordinator's ledger commits, in seq
        order, once committed — its recovery's too (`Ledger.after_append`; it must not raise).

        `client`: the HTTP client every control call is sent on (`coordinator/http.py`), e.g. one the
        host shares between coordinators; the caller keeps it and closes it — the coordinator never
        does. Default: a client of its own, closed when the coordinator closes.

        It runs on asyncio (uvloop included): its HTTP client and the PostgreSQL driver are
        asyncio's. Under another event loop (trio) it raises `QuiesceError` before anything opens.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise QuiesceError(
                "quiesce's coordinator runs on asyncio (uvloop included) — its HTTP client and the"
                " PostgreSQL driver are asyncio's — but this code runs under another event loop"
                " (trio?). Run it under asyncio: anyio.run(main, backend='asyncio'), or asyncio.run"
            ) from None
        cfg = _as_config(config)
        source = (
            config_path
            if config_path is not None
            else (None if isinstance(config, ClusterConfig) else config)
        )
        if token is not None and (problem := token_problem(token)) is not None:
            raise ConfigError(f"{problem}; give the bearer token alone")  # before the ledger is opened
        secret = token if token is not None else find_token(cfg)
        if secret is None and require_token:
            raise ConfigError(missing_token(cfg))
        if advertise is not None and (not advertise or any(c.isspace() for c in advertise)):
            raise ConfigError(
                f"advertise {advertise!r}: give an address without spaces, e.g. http://host:port"
            )
        if standby and not cfg.ledger.startswith("postgresql"):
            raise ConfigError(
                f"standby needs a PostgreSQL ledger (ledger: postgresql+asyncpg://...); {cfg.ledger} is"
                " SQLite, which has one writer per host — run a single coordinator instead"
            )
        identity = {"host": socket.gethostname(), "pid": os.getpid(), "uuid": str(uuid.uuid4())}
        lease = LeaseTerms(
            holder=holder_text(identity, advertise),
            ttl_s=cfg.lease_s,
            standby=standby,
        )
        points = crashpoints.from_env()
        async with Ledger.open(
            cfg.ledger,
            durability=cfg.durability,
            secrets=(secret,) if secret is not None else (),
            lease=lease,
            after_append=_chained(points.after_append if points is not None else None, observe),
        ) as ledger:
            await ledger.start_epoch({"coordinator": identity, "version": quiesce_version()})
            caller = Caller(ledger, secret, epoch=ledger.epoch, client=client, no_token=missing_token(cfg))
            guard = LeaseGuard()
            try:
                async with _lease_kept(ledger, cfg.lease_s / 3, guard):
                    path = os.fspath(source) if source is not None else None
                    coord = cls(
                        Context(cfg, ledger, caller, on_progress, config_path=path, service=advertise), guard
                    )
                    if recover and secret is not None:
                        with heap_frozen():
                            coord._last_recovery = await recovery.recover(coord._ctx, always_record=False)
                    yield coord
            finally:
                with anyio.CancelScope(shield=True):
                    await caller.aclose()

    @stops_when_fenced
    @frozen_step
    async def recover(self) -> recovery.RecoveryReport:
        """Run recovery now (`quiesce recover`): always records `recovery.started`/`completed`."""
        self._ctx.caller.require_token()  # before anything is read or recorded
        self._idle("recover")
        self._changing()
        report = await recovery.recover(self._ctx, always_record=True)
        self._last_recovery = report
        return report

    @property
    def last_recovery(self) -> recovery.RecoveryReport | None:
        """What the last recovery of this coordinator found and did (None if it did not run)."""
        return self._last_recovery

    # -- properties ----------------------------------------------------------------------------

    @property
    def config(self) -> ClusterConfig:
        return self._ctx.config

    @property
    def ledger(self) -> Ledger:
        return self._ctx.ledger

    @property
    def epoch(self) -> int:
        return self._ctx.ledger.epoch

    @property
    def discovery(self) -> Discovery | None:
        """The last successful discovery, if any."""
        return self._discovery

    @property
    def current(self) -> Attempt | None:
        """The attempt awaiting its next step in this process, if any."""
        return self._current

    @property
    def latest_snapshot(self) -> Path | None:
        """The snapshot folder `LATEST` names, if any."""
        return read_latest(self._ctx.config.snapshots)

    def set_progress(self, callback: ProgressCallback | None) -> None:
        self._ctx.on_progress = callback

    # -- discovery -----------------------------------------------------------------------------

    @stops_when_fenced
    @frozen_step
    async def discover(self, *, strict: bool = True) -> Discovery:
        """Capabilities of every configured server → participants (see `discovery.py`).

        Raises `DiscoveryError` listing every refusal (recorded in `discovery.completed` first);
        with `strict=False` returns the refusals instead (and the result is not used for attempts).
        """
        found = await discover(self._ctx.config, self._ctx.caller, self._ctx.ledger, strict=strict)
        if not found.refused:
            self._discovery = found
        fresh: Mapping[str, Fence | str] = found.statuses if found.plane == "v2" else found.found
        self._fresh, self._clean = fresh, False
        return found

    # -- what holds the servers ----------------------------------------------------------------

    async def status(self, *, ledger: Ledger | None = None) -> ClusterStatus:
        """Every configured server's fence, read live, and what holds each held one: its kind,
        since when, and the exact command that frees it (`quiesce.coordinator.status`). Records nothing.

        `ledger` is where holders are looked up (default: this coordinator's); a service passes its
        read-only one, so a status read while an attempt runs never waits on that attempt's appends."""
        caller = self._ctx.caller
        return await read_status(
            self._ctx.config,
            ledger if ledger is not None else self._ctx.ledger,
            lambda name, url, deadline: caller.peek_capabilities(name, url, deadline_ts=deadline),
            config_path=self._ctx.config_path,
            via=self._ctx.service,
            peek_v2=lambda name, url, deadline: caller.peek_v2_status(name, url, deadline_ts=deadline),
        )

    async def _ask(self, names: list[str] | None = None) -> ClusterStatus:
        """`status()` of `names` (default: every server) by recorded reads: a decision rests on it."""
        caller = self._ctx.caller

        def read(name: str, url: str, deadline: float) -> Awaitable[CallResult]:
            return caller.capabilities(name, url, deadline_ts=deadline, phase="status")

        def read_v2(name: str, url: str, deadline: float) -> Awaitable[CallResult]:
            return caller.v2_status(name, url, deadline_ts=deadline, phase="status")

        return await read_status(
            self._ctx.config,
            self._ctx.ledger,
            read,
            config_path=self._ctx.config_path,
            names=names,
            via=self._ctx.service,
            peek_v2=read_v2,
        )

    async def _refuse_if_held(self, discovery: Discovery, what: str) -> None:
        """`ServersHeld` if a participant is held by another checkpoint id; nothing is sent before.

        Free of cost while this coordinator's own last step left every participant idle; else from
        the fences discovery read if nothing was sent since, or from a new (recorded) read."""
        if self._clean:
            return
        names = discovery.names
        if self._fresh is not None:
            found = {n: self._fresh[n] for n in names if n in self._fresh}
            status = await status_from(
                self._ctx.config,
                self._ctx.ledger,
                found,
                config_path=self._ctx.config_path,
                via=self._ctx.service,
            )
        else:
            status = await self._ask(names)
        refuse_if_held(status, names, what)

    def _changing(self) -> None:
        """Requests are about to be sent: what was known of the fences no longer holds. Without a
        control token nothing may be sent: `ConfigError` naming the variable to set."""
        self._ctx.caller.require_token()
        self._fresh, self._clean = None, False

    async def _discovered(self) -> Discovery:
        return self._discovery if self._discovery is not None else await self.discover()

    def _idle(self, what: str) -> None:
        current = self._current
        if current is not None and current.state not in ("completed", "aborted"):
            raise QuiesceError(
                f"cannot {what}: attempt {current.checkpoint_id} is {current.state}; resume or abort it first"
            )

    def _pick(self, attempt: Attempt | None, what: str) -> Attempt:
        chosen = attempt or self._current
        if chosen is None:
            raise QuiesceError(f"cannot {what}: no attempt in progress; call prepare() first")
        return chosen

    # -- save, step-wise -----------------------------------------------------------------------

    @stops_when_fenced
    @frozen_step
    async def prepare(
        self,
        *,
        deadline_s: float | None = None,
        stop: bool = False,
        into: str | os.PathLike[str] | None = None,
        in_place: bool = False,
    ) -> Attempt:
        """Start a save attempt and prepare it. Rolls back and raises on failure.

        v1: pause, prepare, drain. Gym's unified plane (v2): stage by stage, asking a server again
        while it answers `preparing`; not ready by the deadline → rolled back, each server's
        blockers named (`save_v2`). `stop` (v2 only) marks a stop-checkpoint: once published, its
        servers stay paused for shutdown. `into` (v2 only): the folder to commit into and publish in
        place, instead of quiesce's own snapshots folder — see `save`. `in_place` (v2 only): the
        same, into a folder not known yet, which `commit(into=...)` names (NeMo RL's per-actor
        calls name it only at commit); until then the attempt has no staging folder.

        Before anything is recorded or called: `deadline_s` is checked (`ConfigError` when it is not a
        finite number of seconds in (0, `max_deadline_s`]) and the snapshots folder passes the
        preflight (`SnapshotError`; its warnings go on the attempt and into `attempt.started`)."""
        self._ctx.caller.require_token()  # before anything is read or recorded
        self._idle("prepare")
        budget = check_deadline(self._ctx.config, deadline_s)
        warnings = await anyio.to_thread.run_sync(preflight, self._ctx.config)  # before anyone is paused
        discovery = await self._discovered()
        if stop and discovery.plane != "v2":
            raise QuiesceError(
                "a stop-checkpoint (stop=True, --stop) needs Gym's unified plane; this cluster speaks v1"
            )
        folder = self._in_place_folder(discovery, into) if into is not None else None
        if in_place and discovery.plane != "v2":
            raise QuiesceError(
                "a save published in place (in_place=True) needs Gym's unified plane; this cluster"
                " speaks v1, whose snapshots go into quiesce's snapshots folder"
            )
        await self._refuse_if_held(discovery, "checkpoint")
        self._changing()
        attempt = await saving.start_attempt(
            self._ctx,
            discovery,
            deadline_s=budget,
            warnings=warnings,
            stop=stop,
            into=folder,
            in_place=in_place,
        )
        self._current = attempt
        if attempt.plane == "v2":
            await save_v2.prepare(
                self._ctx, attempt, budget_s=budget if budget is not None else self._ctx.config.deadline_s
            )
        else:
            await saving.prepare(self._ctx, attempt)
        return attempt

    def _in_place_folder(self, discovery: Discovery, into: str | os.PathLike[str]) -> Path:
        """`into` as the absolute folder a save commits into in place, or `QuiesceError` saying why
        it cannot be (checked before anything is recorded or sent)."""
        if discovery.plane != "v2":
            raise QuiesceError(
                "a save into a folder of the caller's (into=...) needs Gym's unified plane; this cluster"
                " speaks v1, whose snapshots go into quiesce's snapshots folder"
            )
        folder = Path(os.path.abspath(os.fspath(into)))  # not resolved: a symlink is refused, not followed
        snapshots = Path(os.path.abspath(self._ctx.config.snapshots))
        if folder == snapshots or snapshots in folder.parents or folder in snapshots.parents:
            raise QuiesceError(
                f"{folder} overlaps quiesce's snapshots folder {snapshots}, whose retention and sweeps"
                " would remove it; give a folder outside it"
            )
        problem = in_place_problem(folder, in_place_roots(m.folder for m in discovery.participants))
        if problem is not None:
            raise QuiesceError(problem)
        return folder

    @stops_when_fenced
    @frozen_step
    async def commit(
        self,
        attempt: Attempt | None = None,
        *,
        episodes: Sequence[EpisodeId] | None = None,
        into: str | os.PathLike[str] | None = None,
        deadline_s: float | None = None,
    ) -> Attempt:
        """Commit a prepared attempt into its staging folder; verifies every digest. Rolls back on failure.

        `deadline_s` (unified plane): the commit works to a budget of its own from now, recorded in
        its `phase.started` — for a caller that gives every step its own deadline, as NeMo RL's
        per-actor calls do — instead of the attempt's (None).

        `episodes` (Gym's unified plane only): the episodes the caller continues — the commit
        scope, minus the restarts the servers reported (`attempt.restarts`). None: derived from
        the environment servers' own export; a cluster without one is refused (rolled back).

        `into`: the folder of an attempt prepared with `in_place=True` (required there, refused
        anywhere else), checked as `save(into=...)` checks it; a folder refused rolls back."""
        chosen = self._pick(attempt, "commit")
        budget = check_deadline(self._ctx.config, deadline_s) if deadline_s is not None else None
        deferred = chosen.in_place and chosen.staging_dir is None
        folder: Path | None = None
        if into is not None or deferred:
            problem: str | None = None
            if not deferred:
                problem = (
                    f"attempt {chosen.checkpoint_id} already has its folder ({chosen.staging_dir});"
                    " give `into` only to an attempt prepared with in_place=True"
                )
            elif into is None:
                problem = (
                    f"attempt {chosen.checkpoint_id} was prepared in place with no folder; name it:"
                    " commit(into=FOLDER)"
                )
            else:
                try:
                    folder = self._in_place_folder(await self._discovered(), into)
                except QuiesceError as refused:
                    problem = str(refused)
            if problem is not None and chosen.state == "prepared":
                with anyio.CancelScope(shield=True), heap_frozen():
                    rolled = await roll_back(self._ctx, chosen, None, reason=problem)
                raise QuiesceError(f"{problem}. {rolled}")
            if problem is not None:
                raise QuiesceError(problem)
        if chosen.plane == "v2":
            await save_v2.commit(
                self._ctx, chosen, episodes=episodes, stop=chosen.stop, into=folder, budget_s=budget
            )
        elif episodes is not None:  # prepared already: let go of the servers before refusing
            reason = "an episode scope is a notion of Gym's unified plane; this cluster speaks v1"
            with anyio.CancelScope(shield=True), heap_frozen():
                error = await roll_back(self._ctx, chosen, None, reason=reason)
            raise QuiesceError(f"{reason}. {error}")
        else:
            await saving.commit(self._ctx, chosen)
        return chosen

    @stops_when_fenced
    async def renew(self, attempt: Attempt | None = None, *, horizon_s: float | None = None) -> Attempt:
        """Renew the leases of a unified-plane attempt's servers once (for callers driving
        prepare → commit → publish step by step; `save()` renews on its own): each is kept for
        `horizon_s` (default: the config's `deadline_s`) plus its grace. Raises `QuiesceError` when a
        server no longer holds the attempt (its state ran on since the commit: do not publish)."""
        chosen = self._pick(attempt, "renew")
        if chosen.plane != "v2":
            return chosen
        await renew_all(
            self._ctx, chosen, horizon_s if horizon_s is not None else self._ctx.config.deadline_s
        )
        if chosen.lease_lost is not None:
            raise QuiesceError(chosen.lease_lost)
        return chosen

    @stops_when_fenced
    @frozen_step
    async def publish(self, attempt: Attempt | None = None) -> Path:
        """Publish a committed attempt (manifest, rename, LATEST, retention); returns the snapshot
        folder once `attempt.published` is on disk (the ledger's durability permitting)."""
        chosen = self._pick(attempt, "publish")
        published = await saving.publish(self._ctx, chosen)
        await self._ctx.ledger.sync()
        return published

    @stops_when_fenced
    @frozen_step
    async def abort(
        self, target: Attempt | str | None = None, *, reason: str = "aborted by request"
    ) -> Outcome:
        """Roll back an attempt before publication: resume every server it may have paused, remove
        its staging folder. `target`: an `Attempt`, a checkpoint id, or None — the attempt
        awaiting its next step in this process, else whatever holds the servers (asked now).

        An attempt already published cannot be rolled back: it is resumed instead (outcome
        `published`); a restore is finished and resumed (`resumed`); what a recorded attempt left
        paused is resumed (`readback.release`). Outcome `none` when nothing holds the servers.
        """
        self._ctx.caller.require_token()  # before the servers are even asked what holds them
        chosen = target if isinstance(target, Attempt) else None
        current = self._current
        awaiting = current is not None and current.state not in ("completed", "aborted")
        if current is not None and awaiting and target in (None, current.checkpoint_id):
            chosen = current
        if chosen is None:
            return await self._let_go(target if isinstance(target, str) else None, reason=reason)
        self._changing()
        if chosen.state in ("published", "restored"):
            return self._note(await self._finish_resume(chosen))
        if chosen.state in ("completed", "aborted"):
            return Outcome(chosen.checkpoint_id, "none")
        error = await roll_back(self._ctx, chosen, None, reason=reason)
        return self._note(
            Outcome(
                chosen.checkpoint_id,
                "aborted",
                tuple(resume_sorted(chosen, chosen.touched)),
                tuple(error.resumed),
                (),
                tuple(error.not_resumed),
            )
        )

    @stops_when_fenced
    @frozen_step
    async def resume(self, target: Attempt | str | None = None) -> Outcome:
        """Resume the servers an attempt left paused (a published save, a restore, a rollback).

        `target`: an `Attempt`, a checkpoint id, or None — the attempt awaiting its resume in this
        process, else whatever holds the servers (asked now; every holding id is let go, the
        others' outcomes in `Outcome.also`). An unfinished restore is finished from its snapshot
        first. Outcome `none` when nothing holds the servers. Raises `PhaseError` when a server
        cannot be resumed (retry the same id once it can).
        """
        self._ctx.caller.require_token()  # before the servers are even asked what holds them
        chosen = target if isinstance(target, Attempt) else self._current if target is None else None
        if isinstance(target, str) and self._current is not None and self._current.checkpoint_id == target:
            chosen = self._current
        if chosen is not None and chosen.state in ("published", "restored"):
            self._changing()
            return self._note(await self._finish_resume(chosen))
        if chosen is not None and chosen.state not in ("completed", "aborted"):
            raise QuiesceError(
                f"cannot resume attempt {chosen.checkpoint_id}: it is {chosen.state}; publish it first,"
                " or abort() it to roll back"
            )
        if isinstance(target, Attempt):
            return Outcome(target.checkpoint_id, "none")
        return await self._let_go(target, reason="resumed by request before publication")

    async def _finish_resume(self, attempt: Attempt) -> Outcome:
        """Resume a published save or a restore; a restore's outcome carries its `resubmit`."""
        outcome = await finish_resume(self._ctx, attempt)
        if attempt.kind != "restore":
            return outcome
        return replace(
            outcome,
            resubmit=attempt.resubmit,
            restart=attempt.restart,
            resubmit_unknown=attempt.resubmit_unknown,
        )

    async def _let_go(self, checkpoint_id: str | None, *, reason: str) -> Outcome:
        """Let go of `checkpoint_id`, or (None) of every id that holds a server now, oldest first."""
        status = await self._ask()
        self._changing()
        # every server answered and nothing but what is let go here holds one: all idle after
        known = all(s.reachable for s in status.servers)
        if checkpoint_id is not None:
            alone = {h.checkpoint_id for h in status.holders} <= {checkpoint_id}
            return self._note(await self._release(checkpoint_id, status, reason), clean=known and alone)
        # this ledger's attempts by start, then ids it does not know
        order = [
            h.checkpoint_id
            for h in sorted(status.holders, key=lambda h: (not h.recorded, h.started_at or ""))
        ]
        if not order:
            self._clean = known
            return Outcome(None, "none")
        outcomes = [await self._release(cid, status, reason) for cid in order]
        first = outcomes[0]
        merged = replace(first, also=tuple(outcomes[1:]))
        return self._note(merged, clean=known)

    async def _release(self, checkpoint_id: str, status: ClusterStatus, reason: str) -> Outcome:
        held = status.held_by(checkpoint_id)
        recorded = await read_attempt(self._ctx.ledger, self._ctx.config, checkpoint_id)
        if recorded is not None:
            return await release(self._ctx, recorded, reason=reason, held=held)
        if not held:
            raise QuiesceError(
                f"checkpoint {checkpoint_id} is not an attempt of this ledger ({self._ctx.config.ledger})"
                " and no server reports it active: nothing to do. `quiesce status --config ...` shows what"
                " holds each server"
            )
        members: list[Member] = []
        for name in held:
            server = status.server(name)
            if server is not None and server.plane == "v2" and server.kind in V2_ROLE_OF_KIND:
                role_v2 = V2_ROLE_OF_KIND[server.kind]
                policy = "policy" if role_v2 == "policy" else None
                members.append(
                    Member(name, server.kind, "export_restore", policy, role_v2, server.url, plane="v2")
                )
                continue
            caps = server.capabilities if server is not None else None
            role = next(
                (r for r, c in COMPONENT_OF_ROLE.items() if caps is not None and c == caps.component), None
            )
            if server is None or caps is None or role is None:
                continue
            members.append(
                Member(name, caps.component, caps.checkpoint_mode, caps.instance_role, role, server.url)
            )
        return await release_unrecorded(self._ctx, checkpoint_id, members)

    def _note(self, outcome: Outcome, *, clean: bool = True) -> Outcome:
        """Remember whether this step left every participant idle (no `_ask` before the next attempt)."""
        self._clean = clean and not outcome.left_paused and all(not o.left_paused for o in outcome.also)
        return outcome

    # -- save, whole ---------------------------------------------------------------------------

    @asynccontextmanager
    async def save(
        self,
        *,
        deadline_s: float | None = None,
        episodes: Sequence[EpisodeId] | None = None,
        stop: bool = False,
        into: str | os.PathLike[str] | None = None,
    ) -> AsyncIterator[Attempt]:
        """Prepare and commit on entry; yield the attempt (write into `attempt.staging_dir`).

        Normal exit publishes, then resumes (`attempt.snapshot` is then the published folder); the
        snapshots retention removed are deleted while the servers resume, not before. An
        exception inside the block rolls back (every touched server resumed, staging removed) and
        is re-raised unchanged; what the rollback did is in the ledger and in a note on the error.

        On Gym's unified plane (v2): `episodes` is the commit scope (see `commit`; refused before
        any request when it cannot be derived), `stop=True` commits with `stop`, publishes and
        leaves the servers paused for shutdown. While the block and the publication run, every
        server's lease is renewed (`renewal.py`); a renewal refused — a server let go of the save
        on its own — fails the save on leaving the block: rolled back, nothing published.

        `into` (unified plane): commit into this folder of the caller's (e.g. the snapshot folder
        NeMo RL publishes itself) instead of quiesce's snapshots folder, and publish there in
        place: the servers write only their folders in it (each server's `folder`, or Gym's `gym/`),
        which must not be there yet; publication verifies and hashes those alone and writes
        `quiesce-manifest.json` beside them (the commit point); nothing is renamed, LATEST and
        retention are left alone, and a rollback removes only what the servers wrote. The folder
        is then a snapshot `restore` takes like any other, checked against the ledger.
        """
        self._ctx.caller.require_token()  # before anything is read or recorded
        discovery = await self._discovered()
        if discovery.plane == "v2":
            save_v2.require_scope(discovery.participants, episodes)  # before any request
        elif episodes is not None or stop:
            raise QuiesceError("episodes and stop are notions of Gym's unified plane; this cluster speaks v1")
        attempt = await self.prepare(deadline_s=deadline_s, stop=stop, into=into)
        await self.commit(attempt, episodes=episodes)
        horizon = deadline_s if deadline_s is not None else self._ctx.config.deadline_s
        raised: BaseException | None = None
        # the renewals end before anything lets the servers go: no renew follows a resume
        async with renewing(self._ctx, attempt, horizon):
            try:
                yield attempt
            except BaseException as exc:  # rolled back below, once the renewals have stopped
                raised = exc
        if raised is not None:
            with anyio.CancelScope(shield=True), heap_frozen():
                error = await roll_back(
                    self._ctx, attempt, None, reason=f"the caller's block raised {type(raised).__name__}"
                )
            raised.add_note(str(error))
            raise raised
        if attempt.lease_lost is not None:
            with heap_frozen():
                error = await roll_back(
                    self._ctx, attempt, None, reason=f"a lease was lost: {attempt.lease_lost}"
                )
            raise error
        if attempt.stop:
            with heap_frozen():
                async with renewing(self._ctx, attempt, horizon):
                    await saving.publish(self._ctx, attempt)
                await self._stopped(attempt)
            return
        await self.publish_and_resume(attempt, renew_horizon=horizon)

    async def _stopped(self, attempt: Attempt) -> None:
        """End a published stop-checkpoint: its servers stay paused for shutdown (recorded as
        `attempt.completed {published}` with no server resumed)."""
        await self._ctx.ledger.append(
            "attempt.completed",
            checkpoint_id=attempt.checkpoint_id,
            data={"servers": [], "outcome": "published"},
        )
        attempt.state = "completed"
        self._clean = False

    @stops_when_fenced
    async def publish_and_resume(
        self, attempt: Attempt | None = None, *, renew_horizon: float | None = None
    ) -> Path:
        """What leaving `save()` does: publish a committed attempt, then resume its servers; the
        snapshots retention removed are deleted while the servers resume, not before. Returns the
        published folder; a failed resume leaves the snapshot published and is raised once the
        deleting is done (`resume()` retries it). On the unified plane the servers' leases are
        renewed while the publication runs (`renew_horizon`, default the config's `deadline_s`)."""
        chosen = self._pick(attempt, "publish")
        failed: Exception | None = None
        horizon = renew_horizon if renew_horizon is not None else self._ctx.config.deadline_s
        with heap_frozen():
            # a lease lost now is harmless: the caller's half was written while every server was
            # still paused, and the resume that follows is idempotent
            async with renewing(self._ctx, chosen, horizon):
                published = await saving.publish(self._ctx, chosen, defer_delete=True)
            unsynced: list[LedgerError] = []

            async def outcome_on_disk() -> None:
                try:
                    await self._ctx.ledger.sync(ending=False)  # the resume goes on writing
                except LedgerError as error:  # the resume goes on; raised once it is done
                    unsynced.append(error)

            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, empty_trash, self._ctx.config.snapshots)
                # the caller hears "published" only once `attempt.published` is on disk; the sync
                # runs while the servers resume, not before
                tg.start_soon(outcome_on_disk)
                try:
                    await self.resume(chosen)
                except Exception as error:  # raised once the deleting is done
                    failed = error
            # the save is over: the ledger's upkeep may run once it is quiet, not during the resume
            self._ctx.ledger.operation_ended()
        if failed is not None:
            raise failed
        if unsynced:
            raise unsynced[0]
        return published

    @stops_when_fenced
    async def checkpoint(
        self,
        *,
        deadline_s: float | None = None,
        episodes: Sequence[EpisodeId] | None = None,
        stop: bool = False,
        into: str | os.PathLike[str] | None = None,
    ) -> Attempt:
        """prepare → commit → publish → resume, with nothing added by the caller (`episodes`,
        `stop`, `into`: Gym's unified plane, see `save`)."""
        async with self.save(deadline_s=deadline_s, episodes=episodes, stop=stop, into=into) as attempt:
            pass
        return attempt

    # -- restore -------------------------------------------------------------------------------

    @stops_when_fenced
    @frozen_step
    async def restore(
        self,
        snapshot: str | os.PathLike[str] | None = None,
        *,
        deadline_s: float | None = None,
        resume: bool = False,
    ) -> Attempt:
        """Restore a snapshot (a folder, a checkpoint id under `snapshots`, or None/"latest").

        The snapshot is verified before any server is contacted: its manifest against its folder
        name and against the digest the ledger recorded at publication (`provenance`; a snapshot
        the ledger does not know gets a warning on the attempt saying what was not verified), then
        every file and checksum, and its participant set against discovery (`SnapshotError`
        lists every difference). `deadline_s` is checked like the config's (`check_deadline`). A
        participant held by another checkpoint id refuses it (`ServersHeld`). The servers stay
        paused until `resume()` — or, with `resume=True`, are resumed at once: the attempt ends
        only once resumed (a death before that is finished by recovery), `attempt.state` completed.

        Nothing runs a restored rollout until the caller sends its `/run` again:
        `attempt.resubmit` lists those executions (each saved agent record's rollout as attempt
        n+1, `restore.read_resubmissions`), read before any server is contacted; an agent whose
        folder does not say (another layout, a file that is not a record, an identity not its
        file name) is listed in `attempt.resubmit_unknown` with the reason and the restore goes
        on, while a record that is not the one its agent committed (missing, another digest)
        refuses it (`SnapshotError`). Continuations that depend on a `restart_only` resources
        server are discarded on the agents that can (`restore.discards`) and listed in
        `attempt.restart` instead. Resuming the restore returns them again (`Outcome`).
        """
        self._ctx.caller.require_token()  # before anything is read or recorded
        self._idle("restore")
        budget = check_deadline(self._ctx.config, deadline_s)
        path = resolve_snapshot(self._ctx.config.snapshots, snapshot)
        # before any server is contacted: the manifest against its folder name and the ledger's record
        origin = await check_provenance(self._ctx.ledger, path)
        discovery = await self._discovered()
        expected = {m.name: m.component for m in discovery.exporters}  # not a drain-only model
        verified = await anyio.to_thread.run_sync(lambda: verify_snapshot(path, participants=expected))
        if discovery.plane == "v2":
            return await self._restore_v2(discovery, verified, budget, origin, resume)
        agents = [m for m in discovery.exporters if m.role == "agent"]
        found = await anyio.to_thread.run_sync(read_resubmissions, verified, agents)
        restart_only = discovery.restart_only_resources
        discarding = [m.name for m in agents if can_discard(m)]
        await anyio.to_thread.run_sync(discard_plan, verified, discarding, restart_only)
        warnings = [origin.warning] if origin.warning else []
        await self._refuse_if_held(discovery, "restore")
        self._changing()
        attempt = await restore_snapshot(
            self._ctx,
            discovery,
            verified,
            deadline_s=budget,
            warnings=warnings,
            resume=resume,
            manifest_sha256=origin.manifest_sha256,
            resubmit=found.known,
            unknown=found.unknown,
            restart_only=restart_only,
            discarding=discarding,
        )
        self._current = attempt
        if resume:
            attempt.resume_outcome = self._note(await self._finish_resume(attempt))
        return attempt

    async def _restore_v2(
        self, discovery: Discovery, verified: Snapshot, budget: float | None, origin: Provenance, resume: bool
    ) -> Attempt:
        """A unified-plane restore (`restore_v2`): all or nothing; `attempt.resubmit` lists the
        replacement attempts the trainer starts once the servers resume."""
        warnings = [origin.warning] if origin.warning else []
        await self._refuse_if_held(discovery, "restore")
        self._changing()
        try:
            attempt = await restore_v2.restore(
                self._ctx,
                discovery,
                verified,
                deadline_s=budget,
                warnings=warnings,
                resume=resume,
                manifest_sha256=origin.manifest_sha256,
            )
        finally:
            self._clean = False
        self._current = attempt
        if resume:
            attempt.resume_outcome = self._note(await self._finish_resume(attempt))
        return attempt

    # -- retire and forget (Gym's unified plane) -------------------------------------------------

    async def _operation(self, what: str, deadline_s: float | None) -> Attempt:
        """The attempt a retire or forget is sent under: the restore left `restored` in this process
        (its servers require its id), else a new id of its own. Refused before anything is sent while
        a save of this process is open, or on a v1 cluster."""
        self._ctx.caller.require_token()
        discovery = await self._discovered()
        if discovery.plane != "v2":
            raise QuiesceError(f"{what} is an operation of Gym's unified plane; this cluster speaks v1")
        current = self._current
        if current is not None and current.kind == "save" and current.state not in ("completed", "aborted"):
            raise QuiesceError(
                f"cannot {what} while checkpoint {current.checkpoint_id} is open ({current.state}): Gym"
                " refuses both until its servers are resumed — publish or abort it, then resume first"
            )
        budget = check_deadline(self._ctx.config, deadline_s)
        seconds = budget if budget is not None else self._ctx.config.deadline_s
        if current is not None and current.kind == "restore" and current.state == "restored":
            current.deadline_ts = time.time() + seconds
            return current
        # what holds the servers now (read, recorded): a restore left `restored` — by any process —
        # requires its own id; anything else holding them refuses both until it is resumed
        status = await self._ask(discovery.names)
        restored = {s.held_by for s in status.servers if s.held and s.phase == "restored"}
        others = [s for s in status.servers if s.held and s.phase != "restored"]
        if others or len(restored) > 1:
            named = "; ".join(
                f"{s.name} is {s.phase} under checkpoint {s.held_by}"
                + (f" (free it with `{s.frees}`)" if s.frees else "")
                for s in others or [s for s in status.servers if s.held]
            )
            raise QuiesceError(f"cannot {what}: {named}. Gym refuses both until then: resume first")
        self._changing()
        op_id = next(iter(restored)) if restored else await next_checkpoint_id(self._ctx.ledger)
        assert op_id is not None
        return retiring.operation_attempt(op_id, discovery.participants, seconds)

    @stops_when_fenced
    async def retire(
        self, episodes: Sequence[EpisodeId], *, deadline_s: float | None = None
    ) -> RetireOutcome:
        """Retire these attempts everywhere (callers before callees): each server stops them and every
        earlier attempt of their rollouts, and refuses them (`stale_attempt`) until `forget`.
        Raises `QuiesceError` before anything is sent for no episode, a v1 cluster or a save still
        open here; `PhaseError` naming each server that failed (the calls are recorded either way) —
        a server holding a checkpoint answers that it must be resumed first."""
        if not episodes:
            raise QuiesceError("retire needs at least one episode (rollout_id and attempt)")
        op = await self._operation("retire", deadline_s)
        outcome = await retiring.retire(
            self._ctx, op, list(episodes), deadline_ts=op.deadline_ts, reason="retired by request"
        )
        return self._operation_done(outcome)

    @stops_when_fenced
    async def forget(self, rollout_ids: Sequence[str], *, deadline_s: float | None = None) -> RetireOutcome:
        """Drop the retire marks of these rollouts everywhere (once a rollout is finished for good);
        the same rules as `retire`."""
        if not rollout_ids:
            raise QuiesceError("forget needs at least one rollout id")
        try:
            episodes = [EpisodeId(rollout_id=r) for r in rollout_ids]
        except ValidationError as error:
            raise QuiesceError(f"forget: {_first_problem(error)}") from None
        op = await self._operation("forget", deadline_s)
        outcome = await retiring.forget(
            self._ctx, op, [e.rollout_id for e in episodes], deadline_ts=op.deadline_ts
        )
        return self._operation_done(outcome)

    def _operation_done(self, outcome: RetireOutcome) -> RetireOutcome:
        if outcome.ok:
            return outcome
        named = "; ".join(f"{name}: {why}" for name, why in outcome.failed.items())
        hint = (
            " A server holding a checkpoint refuses it (invalid_phase): resume first"
            f" (`{free_command(self._ctx, 'resume', outcome.checkpoint_id).rsplit(' ', 1)[0]}`)."
            if retiring.resume_first(outcome.failed)
            else ""
        )
        raise PhaseError(
            f"{outcome.operation} of {', '.join(outcome.items)} failed at {named}.{hint} The calls that"
            f" went out are recorded; {outcome.operation} again once the cause is fixed (it is idempotent).",
            phase=outcome.operation,
            server=next(iter(outcome.failed)),
            reason=named,
            checkpoint_id=outcome.checkpoint_id,
        )

    # -- completed results ---------------------------------------------------------------------

    @stops_when_fenced
    async def acknowledge_completed(
        self, server: str, executions: Sequence[tuple[str, int]]
    ) -> list[tuple[str, int]]:
        """Tell agent `server` that the caller now holds these finished results `(rollout_id,
        attempt_index)`; returns the acknowledged set (the requested one).

        Gym keeps every finished rollout until its consumer acknowledges it, and until then the
        agent's prepare is incomplete. Call this once the trainer holds a result, as RL does.
        Refused before anything is sent (`ConfigError`): no control token, a server not in the
        config, one whose capabilities do not list `completed_result_acknowledgement`, no
        execution, a duplicate or an id Gym would refuse. Every request is a recorded control
        call (`call.sent` before it leaves, its outcome after) with the control token; a refusal,
        or a reply that does not cover exactly the requested set, raises `AcknowledgementError`
        and nothing is assumed released. It may run while an attempt is in progress. Once the agent
        acknowledged them, `rollouts.acknowledged` (its `server`: the agent) lists them; that record
        is on disk when this returns.

        The anchor's agent takes the pairs themselves. Later Gym's takes each result's completion
        receipt instead (and answers the pairs with 422, releasing nothing). The receipts are
        then read from the agent — `GET /agent-checkpoint/completion-receipt`, one recorded call
        per result; an agent without that route (404/405) shows them in its status
        (`completed_unacknowledged_attempts[].completion_receipt`, one recorded status read) —
        and sent with exactly the fields the agent gave (never a null it did not give). This
        coordinator sends receipts to that agent from then on, read where they were found.
        """
        self._ctx.caller.require_token()
        configured = self._ctx.config.server(server)
        if configured is None:
            names = ", ".join(s.name for s in self._ctx.config.servers)
            raise ConfigError(f"no server {server!r} in the config (its servers: {names})")
        try:
            pairs = AcknowledgeBody.model_validate(
                {"executions": [{"rollout_id": r, "attempt_index": a} for r, a in executions]}
            )
        except ValidationError as error:
            raise ConfigError(f"cannot acknowledge on {server}: {_first_problem(error)}") from None
        wanted = [(e.rollout_id, e.attempt_index) for e in pairs.executions]
        features = await self._features(server, configured.url)
        if COMPLETED_RESULT_ACKNOWLEDGEMENT not in features:
            raise ConfigError(
                f"{server} does not declare the {COMPLETED_RESULT_ACKNOWLEDGEMENT} feature in its"
                " capabilities: it holds no completed results to acknowledge"
            )
        target = Target(server, AGENT, configured.url)
        refused: CallResult | None = None
        if server not in self._receipt_sources:
            result = await self._acknowledge(target, pairs, wanted)
            if result.ok:
                await self._record_acknowledged(server, result)
                return wanted
            if not (result.error == "http" and result.status == 422):
                raise self._not_acknowledged(server, wanted, result)
            refused = result  # the pairs did not validate: a later Gym may want the receipts
        receipts = await self._receipts(target, wanted, refused)
        result = await self._acknowledge(target, ReceiptAcknowledgeBody(executions=receipts), wanted)
        if not result.ok:
            raise self._not_acknowledged(server, wanted, result)
        await self._record_acknowledged(server, result)
        return wanted

    async def _record_acknowledged(self, server: str, result: CallResult) -> None:
        """Append `rollouts.acknowledged` of an acknowledgement agent `server` answered: the
        executions its reply lists (exactly the requested set), under no checkpoint id. Durable
        (with the call's outcome, which it carries) before `acknowledge_completed` returns: the
        caller may drop its copy of those results then."""
        assert isinstance(result.reply, AcknowledgeReply)
        await self._ctx.ledger.append(
            "rollouts.acknowledged",
            server=server,
            data={
                "executions": [
                    {"rollout_id": e.rollout_id, "attempt": e.attempt_index}
                    for e in result.reply.acknowledged
                ]
            },
        )

    async def _receipts(
        self, target: Target, wanted: list[tuple[str, int]], refused: CallResult | None
    ) -> list[CompletionReceipt]:
        """The completion receipt of each wanted result, as the agent gives it: from its receipt
        route, else (no such route) from its status. `refused`: the 422 the pairs got, which stays
        the error when the agent shows no receipts at all (an anchor agent)."""
        server = target.name
        if self._receipt_sources.get(server, "route") == "route":
            receipts: list[CompletionReceipt] = []
            for execution in wanted:
                read = await self._receipt_read(target, execution)
                if read.ok and isinstance(read.reply, CompletionReceiptReply):
                    receipts.append(read.reply.receipt())
                    continue
                if not receipts and read.status in (404, 405):
                    break  # no receipt route: this agent shows its receipts in its status
                released = (
                    " (a result already acknowledged has no receipt any more)" if read.status == 409 else ""
                )
                raise AcknowledgementError(
                    f"{server} did not acknowledge {_pairs(wanted)}: cannot read the completion receipt"
                    f" of {_pairs([execution])}: {read.describe()}{released}",
                    server=server,
                    status=read.status,
                    code=read.code,
                )
            else:
                self._receipt_sources[server] = "route"
                return receipts
        status_receipts = await self._status_receipts(target, wanted, refused)
        self._receipt_sources[server] = "status"
        return status_receipts

    async def _receipt_read(self, target: Target, execution: tuple[str, int]) -> CallResult:
        """One recorded `GET completion-receipt`; a receipt of another result fails it."""

        def names_it(reply: BaseModel) -> str | None:
            assert isinstance(reply, CompletionReceiptReply)
            named = (reply.rollout_id, reply.attempt_index)
            return (
                None
                if named == execution
                else f"the receipt of {_pairs([named])}, not of {_pairs([execution])}"
            )

        rollout_id, attempt_index = execution
        return await self._ctx.caller.call(
            target,
            route(AGENT, "receipt"),
            phase="acknowledge",
            checkpoint_id=None,
            deadline_ts=time.time() + self._ctx.config.control_timeout_s,
            params=ReceiptQuery(rollout_id=rollout_id, attempt_index=attempt_index).model_dump(),
            check=names_it,
        )

    async def _status_receipts(
        self, target: Target, wanted: list[tuple[str, int]], refused: CallResult | None
    ) -> list[CompletionReceipt]:
        """The receipts of `wanted` from one recorded status read of the agent: each entry of
        `completed_unacknowledged_attempts` carries its result's `completion_receipt`. The read
        names the agent's active checkpoint id, else one of its own that no attempt uses."""
        server = target.name
        deadline = time.time() + self._ctx.config.control_timeout_s
        caps = await self._ctx.caller.capabilities(
            server, target.url, deadline_ts=deadline, phase="acknowledge"
        )
        active = caps.reply.active_checkpoint_id if isinstance(caps.reply, Capabilities) else None
        read = await self._ctx.caller.call(
            target,
            route(AGENT, "status"),
            phase="acknowledge",
            checkpoint_id=None,
            deadline_ts=deadline,
            params={"checkpoint_id": active or f"quiesce-receipts-{uuid.uuid4().hex[:12]}"},
        )
        if not (read.ok and isinstance(read.reply, AgentStatusReply)):
            raise AcknowledgementError(
                f"{server} did not acknowledge {_pairs(wanted)}: cannot read the completion receipts"
                f" from its status: {read.describe()}",
                server=server,
                status=read.status,
                code=read.code,
            )
        shown: dict[tuple[Any, Any], Any] = {}
        for entry in read.reply.completed_unacknowledged_attempts:
            if isinstance(entry, dict) and isinstance(entry.get("completion_receipt"), dict):
                shown[(entry.get("rollout_id"), entry.get("attempt_index"))] = entry["completion_receipt"]
        if not shown and refused is not None:
            raise self._not_acknowledged(server, wanted, refused)  # an agent without receipts
        receipts: list[CompletionReceipt] = []
        for execution in wanted:
            raw = shown.get(execution)
            problem = None if raw is not None else "its status shows no completion receipt of it"
            if raw is not None:
                try:
                    receipt = CompletionReceipt.model_validate(raw)
                except ValidationError as error:
                    problem = (
                        f"its status shows a malformed completion receipt of it ({_first_problem(error)})"
                    )
                else:
                    named = (receipt.rollout_id, receipt.attempt_index)
                    if named != execution:
                        problem = f"its status shows the receipt of {_pairs([named])} for it"
                    receipts.append(receipt)
            if problem is not None:
                raise AcknowledgementError(
                    f"{server} did not acknowledge {_pairs(wanted)}: {_pairs([execution])}: {problem}"
                    " (not a finished result it holds, or one already acknowledged)",
                    server=server,
                    status=read.status,
                )
        return receipts

    async def _acknowledge(
        self, target: Target, body: AcknowledgeBody | ReceiptAcknowledgeBody, wanted: list[tuple[str, int]]
    ) -> CallResult:
        """One recorded `acknowledge-completed`; a reply that does not cover exactly `wanted` fails it."""

        def covers_exactly(reply: BaseModel) -> str | None:
            assert isinstance(reply, AcknowledgeReply)
            got = [(e.rollout_id, e.attempt_index) for e in reply.acknowledged]
            if len(got) == len(set(got)) and set(got) == set(wanted):
                return None
            return f"the reply acknowledges {_pairs(got)}, not exactly the requested {_pairs(wanted)}"

        return await self._ctx.caller.call(
            target,
            route(AGENT, "acknowledge"),
            phase="acknowledge",
            checkpoint_id=None,
            deadline_ts=time.time() + self._ctx.config.control_timeout_s,
            body=body,
            check=covers_exactly,
        )

    @staticmethod
    def _not_acknowledged(
        server: str, wanted: list[tuple[str, int]], result: CallResult
    ) -> AcknowledgementError:
        return AcknowledgementError(
            f"{server} did not acknowledge {_pairs(wanted)}: {result.describe()}",
            server=server,
            status=result.status,
            code=result.code,
        )

    async def _features(self, server: str, url: str) -> tuple[str, ...]:
        """The capability features of `server`: from discovery, else read now (a recorded GET)."""
        if self._discovery is not None and server in self._discovery.features:
            return tuple(self._discovery.features[server])
        result = await self._ctx.caller.capabilities(
            server, url, deadline_ts=time.time() + self._ctx.config.control_timeout_s, phase="acknowledge"
        )
        if not (result.ok and isinstance(result.reply, Capabilities)):
            raise AcknowledgementError(
                f"cannot read the capabilities of {server}: {result.describe()}",
                server=server,
                status=result.status,
                code=result.code,
            )
        if result.reply.component != AGENT:
            raise ConfigError(f"{server} is a {result.reply.component} server, not an agent")
        return tuple(result.reply.features)

    # -- history -------------------------------------------------------------------------------

    async def history(
        self, *, limit: int = 0, before: str | None = None, outcome: str | None = None
    ) -> list[AttemptRow]:
        """The `attempts` projection, oldest first: with `outcome` (`open`: no terminal event yet)
        only those, with `before` only the attempts started before attempt `before`, and with
        `limit` > 0 only the newest `limit` of them — reading that many rows, so
        `history(limit=N, before=<the oldest id of a page>)` is the page before it. An unknown
        `before` raises `QuiesceError`."""
        ledger = self._ctx.ledger
        anchor = None if before is None else await ledger.start_key(before)
        if before is not None and anchor is None:
            raise QuiesceError(f"no attempt {before!r} in the ledger to page back from; history() lists them")
        return await ledger.attempts(outcome=outcome, limit=limit, before=anchor)

    async def rollouts(
        self, rollout_id: str | Sequence[str] | None = None, *, state: str | None = None
    ) -> list[Rollout]:
        """Each rollout's lineage from this coordinator's ledger (`quiesce.ledger.lineage`), with
        its steps: every rollout by rollout id (`rollout_id` None), else the rollouts named, in
        the order named, each once — an id the ledger never recorded is left out; with `state`
        (`live`, `restarted`, `retired`, `finished`, `lost`) only those in it. Read-only: records
        nothing and contacts no server. Another state raises `ConfigError`."""
        if state is not None and state not in STATES:
            raise ConfigError(f"no rollout state {state!r}; the states are {', '.join(STATES)}")
        only = (
            None if rollout_id is None else [rollout_id] if isinstance(rollout_id, str) else list(rollout_id)
        )
        report = await read_lineage_of(self._ctx.ledger, only)
        found = report.rollouts
        ids = sorted(found) if only is None else [r for r in dict.fromkeys(only) if r in found]
        return [found[r] for r in ids if state is None or found[r].state == state]


def _chained(first: AfterAppend | None, second: AfterAppend | None) -> AfterAppend | None:
    """One `after_append` hook calling `first` (the crash points: they may end the process) then `second`."""
    if first is None or second is None:
        return first or second
    hooks = (first, second)

    def both(events: Sequence[Event]) -> None:
        for hook in hooks:
            hook(events)

    return both


@asynccontextmanager
async def _lease_kept(ledger: Ledger, interval_s: float, guard: LeaseGuard) -> AsyncIterator[None]:
    """Renew `ledger`'s lease in the background while the block runs (nothing without a lease);
    once a renewal finds it taken, `guard` stops every step."""
    if ledger.lease is None:
        yield
        return

    async def keep() -> None:
        await keep_lease(ledger, interval_s)  # returns only when the lease is lost: the ledger is fenced
        error = ledger.fenced_error
        guard.lost(error if error is not None else FencedError(f"ledger {ledger.url}: the lease was lost"))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(keep)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:  # the block's own exception, unwrapped from the task group
            raise group.exceptions[0] from None
        raise


def _pairs(executions: Sequence[tuple[str, int]]) -> str:
    return ", ".join(f"{rollout}:{index}" for rollout, index in executions) or "nothing"


def _first_problem(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return f"{where}: {first['msg']}" if where else str(first["msg"])


async def read_history(ledger_url: str) -> list[AttemptRow]:
    """The `attempts` projection of a ledger, read-only (takes no epoch, fences nobody)."""
    async with Ledger.open(ledger_url, readonly=True) as ledger:
        return await ledger.attempts()
