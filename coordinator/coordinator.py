"""`Coordinator`: the embedded async API an RL trainer (or the CLI) drives.

    async with Coordinator.open(config) as coord:          # opens the ledger, takes an epoch
        await coord.discover()
        async with coord.save(deadline_s=60) as attempt:   # prepare + commit on entry
            write_trainer_state(attempt.staging_dir)       # the caller's own half
        # leaving the block publishes, then resumes; an exception inside rolls back and re-raises
        await coord.restore(attempt.snapshot)              # servers stay paused
        await coord.resume()

Step-wise, for an actor that calls one method per RPC: `prepare()` → `commit()` → `publish()` →
`resume()` (or `publish_and_resume()`, what leaving `save()` does), or `abort()` at any point
before publication; `restore(snapshot)` then `resume()`.

Invariants:
- `open` appends `coordinator.started` with a new epoch (fencing any older coordinator) before
  anything else; every later append of an older coordinator raises `FencedError`, and this class
  never catches it: a fenced coordinator stops acting.
- One attempt at a time: a new `prepare` or `restore` while an attempt awaits its next step is
  refused (`QuiesceError`) — finish it (`resume`) or `abort` it first.
- Every control request goes through `calls.Caller` (recorded before and after).
- `resume()` / `abort()` without an attempt in this process act on what the ledger says was left
  paused (the newest attempt without a terminal event, a restore not yet resumed, or a rollback
  that left servers paused), so they work from a separate process.
- `acknowledge_completed(server, executions)` may run at any time, an attempt in progress
  included (an agent holds finished results until acknowledged; a prepare waiting on them
  succeeds at its next retry); it is a recorded control call like any other.

- `open` then runs recovery (`coordinator.recovery`) of whatever a dead coordinator left, unless
  `recover=False`; `recover()` runs it on demand. On PostgreSQL the open coordinator holds the
  lease and renews it in the background (`coordinator.lease`); `open(standby=True)` waits to take
  it over. The test-only crash points (`coordinator.crashpoints`) are read once, here.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.to_thread
from pydantic import BaseModel, ValidationError

from coordinator import crashpoints, recovery
from coordinator import save as saving
from coordinator.attempt import Attempt, Context, Outcome, ProgressCallback, resume_sorted
from coordinator.calls import Caller, Target
from coordinator.config import ClusterConfig, check_deadline, load_config, resolve_token
from coordinator.discovery import Discovery, discover
from coordinator.errors import AcknowledgementError, ConfigError, QuiesceError
from coordinator.heap import frozen_step, heap_frozen
from coordinator.lease import holder_text, keep_lease
from coordinator.preflight import preflight
from coordinator.protocol import (
    AGENT,
    COMPLETED_RESULT_ACKNOWLEDGEMENT,
    AcknowledgeBody,
    AcknowledgeReply,
    Capabilities,
    route,
)
from coordinator.provenance import check_provenance
from coordinator.publish import empty_trash, read_latest, resolve_snapshot, verify_snapshot
from coordinator.readback import find_paused, resume_recorded
from coordinator.restore import restore as restore_snapshot
from coordinator.resume import finish_resume, roll_back
from coordinator.version import VERSION
from ledger import AfterAppend, AttemptRow, Event, LeaseTerms, Ledger

__all__ = ["Coordinator", "quiesce_version", "read_history"]


def quiesce_version() -> str:
    """The version recorded in `coordinator.started` (a constant: no package metadata scan)."""
    return VERSION


def _as_config(config: ClusterConfig | str | os.PathLike[str]) -> ClusterConfig:
    if isinstance(config, ClusterConfig):
        if config.snapshots.is_absolute():
            return config
        return config.model_copy(update={"snapshots": config.snapshots.resolve()})
    return load_config(config)


class Coordinator:
    """One coordinator: one ledger writer with one epoch. Create with `Coordinator.open(...)`."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._discovery: Discovery | None = None
        self._current: Attempt | None = None
        self._last_recovery: recovery.RecoveryReport | None = None

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
    ) -> AsyncIterator[Coordinator]:
        """Load the config (a `ClusterConfig` or a YAML path), open the ledger, take a new epoch.

        The token defaults to the environment (`config.token_env`, then the fallback variable); it
        is given to the ledger as a secret, so it is redacted from everything stored.

        Then, unless `recover=False`, recovery runs (`coordinator.recovery`): every attempt a dead
        coordinator left without a terminal event is finished or rolled back; its report is
        `last_recovery`. On PostgreSQL the coordinator holds the lease (`lease_s`) and renews it in
        the background; `standby=True` first waits until the current holder's lease expires, takes
        it over (ending that holder's writer session), then takes its epoch and recovers. A standby
        needs PostgreSQL: on SQLite it is a `ConfigError`. `advertise` is the address this
        coordinator serves at (`quiesce serve`), written into its lease holder for standbys.
        `observe` is called with the events of each of this coordinator's ledger commits, in seq
        order, once committed — its recovery's too (`Ledger.after_append`; it must not raise).
        """
        cfg = _as_config(config)
        secret = token if token is not None else resolve_token(cfg)
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
            secrets=(secret,),
            lease=lease,
            after_append=_chained(points.after_append if points is not None else None, observe),
        ) as ledger:
            await ledger.start_epoch({"coordinator": identity, "version": quiesce_version()})
            caller = Caller(ledger, secret, epoch=ledger.epoch)
            try:
                async with _lease_kept(ledger, cfg.lease_s / 3):
                    coord = cls(Context(cfg, ledger, caller, on_progress))
                    if recover:
                        with heap_frozen():
                            coord._last_recovery = await recovery.recover(coord._ctx, always_record=False)
                    yield coord
            finally:
                with anyio.CancelScope(shield=True):
                    await caller.aclose()

    @frozen_step
    async def recover(self) -> recovery.RecoveryReport:
        """Run recovery now (`quiesce recover`): always records `recovery.started`/`completed`."""
        self._idle("recover")
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

    @frozen_step
    async def discover(self, *, strict: bool = True) -> Discovery:
        """Capabilities of every configured server → participants (see `discovery.py`).

        Raises `DiscoveryError` listing every refusal (recorded in `discovery.completed` first);
        with `strict=False` returns the refusals instead (and the result is not used for attempts).
        """
        found = await discover(self._ctx.config, self._ctx.caller, self._ctx.ledger, strict=strict)
        if not found.refused:
            self._discovery = found
        return found

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

    @frozen_step
    async def prepare(self, *, deadline_s: float | None = None) -> Attempt:
        """Start a save attempt and prepare it (pause, prepare, drain). Rolls back and raises on failure.

        Before anything is recorded or called: `deadline_s` is checked (`ConfigError` when it is not a
        finite number of seconds in (0, `max_deadline_s`]) and the snapshots folder passes the
        preflight (`SnapshotError`; its warnings go on the attempt and into `attempt.started`)."""
        self._idle("prepare")
        budget = check_deadline(self._ctx.config, deadline_s)
        warnings = await anyio.to_thread.run_sync(preflight, self._ctx.config)  # before anyone is paused
        discovery = await self._discovered()
        attempt = await saving.start_attempt(self._ctx, discovery, deadline_s=budget, warnings=warnings)
        self._current = attempt
        await saving.prepare(self._ctx, attempt)
        return attempt

    @frozen_step
    async def commit(self, attempt: Attempt | None = None) -> Attempt:
        """Commit a prepared attempt into its staging folder; verifies every digest. Rolls back on failure."""
        chosen = self._pick(attempt, "commit")
        await saving.commit(self._ctx, chosen)
        return chosen

    @frozen_step
    async def publish(self, attempt: Attempt | None = None) -> Path:
        """Publish a committed attempt (manifest, rename, LATEST, retention); returns the snapshot folder."""
        chosen = self._pick(attempt, "publish")
        return await saving.publish(self._ctx, chosen)

    @frozen_step
    async def abort(self, attempt: Attempt | None = None, *, reason: str = "aborted by request") -> Outcome:
        """Roll back an attempt before publication: resume every touched server, remove staging.

        Without an attempt in this process, acts on the newest attempt in progress in the ledger.
        An attempt already published cannot be rolled back: it is resumed instead (outcome published).
        """
        chosen = attempt or (
            self._current
            if self._current is not None and self._current.state not in ("completed", "aborted")
            else None
        )
        if chosen is None:
            recorded = await find_paused(self._ctx, in_progress_only=True)
            if recorded is None:
                return Outcome(None, "none")
            return await resume_recorded(self._ctx, recorded, reason=reason)
        if chosen.state in ("published", "restored"):
            return await finish_resume(self._ctx, chosen)
        if chosen.state in ("completed", "aborted"):
            return Outcome(chosen.checkpoint_id, "none")
        error = await roll_back(self._ctx, chosen, None, reason=reason)
        return Outcome(
            chosen.checkpoint_id,
            "aborted",
            tuple(resume_sorted(chosen, chosen.touched)),
            tuple(error.resumed),
            (),
            tuple(error.not_resumed),
        )

    @frozen_step
    async def resume(self, attempt: Attempt | None = None) -> Outcome:
        """Resume the servers an attempt left paused (a published save, or a restore).

        With no attempt awaiting resume in this process, acts on what the ledger says was left
        paused (see the class docstring). Returns outcome `none` when nothing is paused.
        """
        chosen = attempt or self._current
        if chosen is not None and chosen.state in ("published", "restored"):
            return await finish_resume(self._ctx, chosen)
        if chosen is not None and chosen.state not in ("completed", "aborted"):
            raise QuiesceError(
                f"cannot resume attempt {chosen.checkpoint_id}: it is {chosen.state}; publish it first,"
                " or abort() it to roll back"
            )
        recorded = await find_paused(self._ctx)
        if recorded is None:
            return Outcome(None, "none")
        return await resume_recorded(self._ctx, recorded, reason="resumed by request before publication")

    # -- save, whole ---------------------------------------------------------------------------

    @asynccontextmanager
    async def save(self, *, deadline_s: float | None = None) -> AsyncIterator[Attempt]:
        """Prepare and commit on entry; yield the attempt (write into `attempt.staging_dir`).

        Normal exit publishes, then resumes (`attempt.snapshot` is then the published folder); the
        snapshots retention removed are deleted while the servers resume, not before. An
        exception inside the block rolls back (every touched server resumed, staging removed) and
        is re-raised unchanged; what the rollback did is in the ledger and in a note on the error.
        """
        attempt = await self.prepare(deadline_s=deadline_s)
        await self.commit(attempt)
        try:
            yield attempt
        except BaseException as exc:
            with anyio.CancelScope(shield=True), heap_frozen():
                error = await roll_back(
                    self._ctx, attempt, None, reason=f"the caller's block raised {type(exc).__name__}"
                )
            exc.add_note(str(error))
            raise
        await self.publish_and_resume(attempt)

    async def publish_and_resume(self, attempt: Attempt | None = None) -> Path:
        """What leaving `save()` does: publish a committed attempt, then resume its servers; the
        snapshots retention removed are deleted while the servers resume, not before. Returns the
        published folder; a failed resume leaves the snapshot published and is raised once the
        deleting is done (`resume()` retries it)."""
        chosen = self._pick(attempt, "publish")
        failed: Exception | None = None
        with heap_frozen():
            published = await saving.publish(self._ctx, chosen, defer_delete=True)
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, empty_trash, self._ctx.config.snapshots)
                try:
                    await self.resume(chosen)
                except Exception as error:  # raised once the deleting is done
                    failed = error
        if failed is not None:
            raise failed
        return published

    async def checkpoint(self, *, deadline_s: float | None = None) -> Attempt:
        """prepare → commit → publish → resume, with nothing added by the caller."""
        async with self.save(deadline_s=deadline_s) as attempt:
            pass
        return attempt

    # -- restore -------------------------------------------------------------------------------

    @frozen_step
    async def restore(
        self, snapshot: str | os.PathLike[str] | None = None, *, deadline_s: float | None = None
    ) -> Attempt:
        """Restore a snapshot (a folder, a checkpoint id under `snapshots`, or None/"latest").

        The snapshot is verified before any server is contacted: its manifest against its folder
        name and against the digest the ledger recorded at publication (`provenance`; a snapshot
        the ledger does not know gets a warning on the attempt saying what was not verified), then
        every file and checksum, and its participant set against discovery (`SnapshotError`
        lists every difference). `deadline_s` is checked like the config's (`check_deadline`).
        The servers stay paused until `resume()`.
        """
        self._idle("restore")
        budget = check_deadline(self._ctx.config, deadline_s)
        path = resolve_snapshot(self._ctx.config.snapshots, snapshot)
        # before any server is contacted: the manifest against its folder name and the ledger's record
        origin = await check_provenance(self._ctx.ledger, path)
        discovery = await self._discovered()
        expected = {m.name: m.component for m in discovery.exporters}  # not a drain-only model
        verified = await anyio.to_thread.run_sync(lambda: verify_snapshot(path, participants=expected))
        warnings = [origin.warning] if origin.warning else []
        attempt = await restore_snapshot(self._ctx, discovery, verified, deadline_s=budget, warnings=warnings)
        self._current = attempt
        return attempt

    # -- completed results ---------------------------------------------------------------------

    async def acknowledge_completed(
        self, server: str, executions: Sequence[tuple[str, int]]
    ) -> list[tuple[str, int]]:
        """Tell agent `server` that the caller now holds these finished results `(rollout_id,
        attempt_index)`; returns the acknowledged set (the requested one).

        Gym keeps every finished rollout until its consumer acknowledges it, and until then the
        agent's prepare is incomplete. Call this once the trainer holds a result, as RL does.
        Refused before anything is sent (`ConfigError`): a server not in the config, one whose
        capabilities do not list `completed_result_acknowledgement`, no execution, a duplicate or
        an id Gym would refuse. One recorded control call (`call.sent` before it leaves, its
        outcome after) with the control token; a refusal, or a reply that does not cover exactly
        the requested set, raises `AcknowledgementError` and nothing is assumed released. It may
        run while an attempt is in progress.
        """
        configured = self._ctx.config.server(server)
        if configured is None:
            names = ", ".join(s.name for s in self._ctx.config.servers)
            raise ConfigError(f"no server {server!r} in the config (its servers: {names})")
        try:
            body = AcknowledgeBody.model_validate(
                {"executions": [{"rollout_id": r, "attempt_index": a} for r, a in executions]}
            )
        except ValidationError as error:
            raise ConfigError(f"cannot acknowledge on {server}: {_first_problem(error)}") from None
        wanted = [(e.rollout_id, e.attempt_index) for e in body.executions]
        features = await self._features(server, configured.url)
        if COMPLETED_RESULT_ACKNOWLEDGEMENT not in features:
            raise ConfigError(
                f"{server} does not declare the {COMPLETED_RESULT_ACKNOWLEDGEMENT} feature in its"
                " capabilities: it holds no completed results to acknowledge"
            )

        def covers_exactly(reply: BaseModel) -> str | None:
            assert isinstance(reply, AcknowledgeReply)
            got = [(e.rollout_id, e.attempt_index) for e in reply.acknowledged]
            if len(got) == len(set(got)) and set(got) == set(wanted):
                return None
            return f"the reply acknowledges {_pairs(got)}, not exactly the requested {_pairs(wanted)}"

        result = await self._ctx.caller.call(
            Target(server, AGENT, configured.url),
            route(AGENT, "acknowledge"),
            phase="acknowledge",
            checkpoint_id=None,
            deadline_ts=time.time() + self._ctx.config.control_timeout_s,
            body=body,
            check=covers_exactly,
        )
        if not result.ok:
            raise AcknowledgementError(
                f"{server} did not acknowledge {_pairs(wanted)}: {result.describe()}",
                server=server,
                status=result.status,
                code=result.code,
            )
        return wanted

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

    async def history(self) -> list[AttemptRow]:
        """The `attempts` projection, oldest first."""
        return await self._ctx.ledger.attempts()


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
async def _lease_kept(ledger: Ledger, interval_s: float) -> AsyncIterator[None]:
    """Renew `ledger`'s lease in the background while the block runs (nothing without a lease)."""
    if ledger.lease is None:
        yield
        return
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_lease, ledger, interval_s)
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
