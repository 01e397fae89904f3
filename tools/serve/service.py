"""The service's lifecycle and its one-operation-at-a-time rule, around one embedded `Coordinator`.

States: `starting` (SQLite: opening the ledger) or `standby` (PostgreSQL: waiting for the active
service's lease to expire) → `recovering` (lease taken, new epoch, recovery of what the previous
coordinator left) → `ready` → `stopping` → `stopped`. Only `ready` takes requests; every other
state answers `Unavailable` (HTTP 503), a standby with the active service's address (read from the
lease row: `quiesce.coordinator.lease.advertised_address`). A service that loses its lease (fenced) closes
its coordinator and, on PostgreSQL, becomes a standby again.

Invariants:
- **One attempt at a time.** Every request that drives servers runs as an *operation* claimed
  with `Service.run`: a second one while one runs, or while a two-step save (`POST /v1/attempts`)
  awaits its caller's next step, is refused with `Busy` naming the attempt in progress (HTTP 409).
  Only the next step of that very attempt (publish, resume, abort) may claim the slot then.
- **A client never cancels an operation.** An operation runs shielded from cancellation in the
  task that asked for it (the request's): a client that disconnects, or anything else that
  befalls that task, leaves the operation to run to its end (or its rollback) within its own
  deadline, and the result is in the ledger. Stopping waits for it (`_drain`).
- **A two-step save is not left hanging.** Once its deadline has passed without the caller's
  next step, the service rolls it back (or, if it was published, resumes it).
- **Stopping never leaves servers paused.** `stop()` (SIGTERM) takes no new operation, lets the
  one in progress finish within its own deadline, rolls back (or finishes) a two-step save still
  waiting for its caller, then closes the coordinator, which releases the lease so a standby can
  take over at once. A standby that has not yet taken the lease just stops waiting.
- The Gym control token is handed to `Coordinator.open` only (redacted from the ledger there);
  the service never logs or returns it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import anyio
import anyio.abc

from quiesce.coordinator import Attempt, ClusterConfig, Coordinator, Progress
from quiesce.coordinator.errors import FencedError, LedgerError, QuiesceError
from quiesce.coordinator.lease import advertised_address
from quiesce.coordinator.recovery import RecoveryReport
from quiesce.ledger import Event, Ledger
from quiesce.ledger.lineage import LINEAGE_KINDS
from quiesce.tools.serve.errors import Busy, Unavailable
from quiesce.tools.serve.metrics import Metrics
from quiesce.tools.serve.stream import EventHub

T = TypeVar("T")

#: How often a standby reads the lease row to name the active service.
WATCH_S: Final = 0.5
#: How often the active service checks its two-step attempt's deadline and its own lease.
WATCHDOG_S: Final = 0.2


@dataclass
class Operation:
    """What the service is doing now: `name` (e.g. `checkpoint`) and the attempt, once known."""

    name: str
    checkpoint_id: str | None = None
    phase: str | None = None

    def describe(self) -> str:
        what = f"attempt {self.checkpoint_id} ({self.name})" if self.checkpoint_id else f"a {self.name}"
        return what + (f", now in {self.phase}" if self.phase else "")


class Service:
    """One `quiesce serve` process's coordinator and state (see the module docstring)."""

    def __init__(
        self,
        config: ClusterConfig,
        *,
        advertise: str,
        control_token: str | None = None,
        standby: bool | None = None,
        config_path: str | None = None,
    ) -> None:
        self.config = config
        #: the file the config came from: named in the commands errors and `status` tell users to run
        self.config_path = config_path
        self.advertise = advertise
        self._control_token = control_token
        self.standby_mode = config.ledger.startswith("postgresql") if standby is None else standby
        self._state = "starting"
        #: set once the service takes requests, waits as a standby, or has stopped (`runner` announces)
        self.settled = anyio.Event()
        self._idle = anyio.Event()  # set while no operation runs
        self._idle.set()
        self.hub = EventHub()
        self.metrics = Metrics()
        self.coord: Coordinator | None = None
        self.reader: Ledger | None = None
        self.active: str | None = None
        self.recovery: RecoveryReport | None = None
        self.pending: Attempt | None = None
        self.failure: BaseException | None = None
        self._op: Operation | None = None
        self._took_lease = False
        self._stopping = False
        self._stop_requested = anyio.Event()
        self._lease_lost = anyio.Event()
        self.finished = anyio.Event()
        self._open_scope: anyio.CancelScope | None = None

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value
        if value in ("ready", "standby", "stopped"):
            self.settled.set()

    # -- what the routes ask -----------------------------------------------------------------

    @property
    def ready(self) -> bool:
        coord = self.coord
        return self.state == "ready" and coord is not None and coord.ledger.writable

    @property
    def busy(self) -> str | None:
        """What is in progress (the operation, or the two-step attempt awaiting its caller)."""
        if self._op is not None:
            return self._op.describe()
        if self.pending is not None:
            pending = self.pending
            return f"attempt {pending.checkpoint_id} (save), {pending.state}: awaiting its caller's next step"
        return None

    def unavailable(self) -> Unavailable:
        if self.state == "standby":
            where = f"; the active service is at {self.active}" if self.active else ""
            return Unavailable(
                f"this service is a standby: it takes over when the active one's lease expires{where}",
                state=self.state,
                active=self.active,
            )
        if self.state in ("stopping", "stopped"):
            return Unavailable("this service is stopping; retry against the standby", state=self.state)
        return Unavailable(
            f"this service is {self.state}; retry in a moment (GET /readyz says when it is ready)",
            state=self.state,
        )

    def require_reader(self) -> Ledger:
        reader = self.reader
        if reader is None or self.state not in ("ready", "stopping"):
            raise self.unavailable()
        return reader

    def require_observer(self) -> tuple[Coordinator, Ledger]:
        """The coordinator and the read-only ledger, for a read that claims no operation (status):
        served while an attempt runs, like the ledger reads; 503 where they are."""
        reader, coord = self.require_reader(), self.coord
        if coord is None:
            raise self.unavailable()
        return coord, reader

    def require_coordinator(self) -> Coordinator:
        coord = self.coord
        if coord is None or not self.ready or self._stopping:
            raise self.unavailable()
        return coord

    # -- operations ----------------------------------------------------------------------------

    async def run(
        self,
        name: str,
        fn: Callable[[Coordinator], Awaitable[T]],
        *,
        attempt_id: str | None = None,
    ) -> T:
        """Run `fn(coordinator)` as the one operation (see the module docstring) and return its result.

        `attempt_id` names the two-step attempt this operation continues (its publish, resume or
        abort): the only operation allowed while that attempt awaits its caller.
        """
        coord = self.require_coordinator()
        self._claim(name, attempt_id)
        # shielded: nothing that befalls the caller (a client that leaves, its request task
        # cancelled) cancels the operation; it ends on its own deadline, its result in the ledger
        with anyio.CancelScope(shield=True):
            try:
                result = await fn(coord)
            except FencedError:
                self.metrics.fenced()
                self._lease_lost.set()
                raise
            finally:
                self._op = None
                self._idle.set()
        return result

    def _claim(self, name: str, attempt_id: str | None) -> None:
        if self._op is not None:
            op = self._op
            raise Busy(
                f"{op.describe()} is in progress; one attempt at a time — retry once it has ended",
                checkpoint_id=op.checkpoint_id,
                operation=op.name,
            )
        pending = self.pending
        if pending is not None and attempt_id != pending.checkpoint_id:
            raise Busy(
                f"attempt {pending.checkpoint_id} (save) is {pending.state} and awaits its caller's next"
                f" step; POST /v1/attempts/{pending.checkpoint_id}/publish or /abort first",
                checkpoint_id=pending.checkpoint_id,
                operation="save",
            )
        self._op = Operation(name, checkpoint_id=attempt_id)
        self._idle = anyio.Event()

    def _progress(self, report: Progress) -> None:
        op = self._op
        if op is not None:
            op.checkpoint_id = report.checkpoint_id
            op.phase = report.phase

    def _observe(self, events: Sequence[Event]) -> None:
        """The coordinator's `observe` hook: metrics, then the live streams."""
        if not self._took_lease:
            self._took_lease = True  # the first commit is this coordinator's `coordinator.started`
            if self.state in ("starting", "standby"):
                self.state = "recovering"
        self.metrics.observe(events)
        self.hub.publish(events)

    async def settle_metrics(self) -> None:
        """Before a scrape: fold the events observed since the last fold, and count the attempts
        that ended without this process seeing them start (their kind read from the ledger)."""
        self.metrics.fold()
        if self.metrics.unresolved:
            await self._resolve()

    async def _resolve(self) -> None:
        reader = self.reader
        if reader is None:
            return
        ids = list(self.metrics.unresolved)
        try:
            rows = {cid: await reader.attempt(cid) for cid in ids}
        except LedgerError:
            return
        self.metrics.resolve(rows)

    # -- lifecycle -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Begin stopping (SIGTERM; see the module docstring). Returns at once; `finished` is set
        once stopped."""
        if self._stopping:
            return
        self._stopping = True
        self._stop_requested.set()
        if not self._took_lease and self._open_scope is not None:
            self._open_scope.cancel()  # a standby still waiting: nothing to finish

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the lifecycle until `stop()`; `finished` is set when it returns. A failure (the
        ledger cannot be opened, another writer owns it) ends it too: it is kept in `failure`."""
        try:
            task_status.started()
            while not self._stopping:
                await self._once()
                if not self.standby_mode:
                    break  # SQLite: a lost ledger is not waited for
        except Exception as error:
            self.failure = (
                error.exceptions[0]
                if isinstance(error, ExceptionGroup) and len(error.exceptions) == 1
                else error
            )
        finally:
            self.state = "stopped"
            self.hub.close()
            self.finished.set()

    async def _once(self) -> None:
        """One term: wait for the lease (standby), recover, serve until stopped or fenced."""
        self._took_lease = False
        self._lease_lost = anyio.Event()
        self.metrics.new_term()
        self.state = "standby" if self.standby_mode else "starting"
        self._open_scope = scope = anyio.CancelScope()
        watching = anyio.CancelScope()
        with scope:
            async with anyio.create_task_group() as tg:
                if self.standby_mode:
                    tg.start_soon(self._watch_active, watching)
                try:
                    async with Coordinator.open(
                        self.config,
                        token=self._control_token,
                        on_progress=self._progress,
                        standby=self.standby_mode,
                        advertise=self.advertise,
                        observe=self._observe,
                        config_path=self.config_path,
                    ) as coord:
                        watching.cancel()
                        self._open_scope = None
                        await self._active(coord)
                except FencedError:
                    if not self.standby_mode:
                        raise
                finally:
                    watching.cancel()
                    self.coord = None
        self._open_scope = None

    async def _watch_active(self, scope: anyio.CancelScope) -> None:
        """A standby: name the active service (from the lease row) until it takes the lease over."""
        with scope:
            await self._watch_lease()

    async def _watch_lease(self) -> None:
        try:
            async with Ledger.open(self.config.ledger, readonly=True) as reader:
                while True:
                    try:
                        lease = await reader.read_lease()
                    except LedgerError:
                        lease = None
                    if lease is not None and lease.remaining_s > 0:
                        self.active = advertised_address(lease.holder)
                    else:
                        self.active = None
                    await anyio.sleep(WATCH_S)
        except LedgerError:
            return  # no schema yet: nobody is active to name

    async def _active(self, coord: Coordinator) -> None:
        self._took_lease = True
        self.state = "recovering"
        self.active = None
        self.coord = coord
        self.recovery = coord.last_recovery
        coord.ledger.on_commit = self.metrics.commit
        ledger = coord.ledger
        self.metrics.lease_from(lambda: self.coord is coord and ledger.writable)
        try:
            async with Ledger.open(self.config.ledger, readonly=True) as reader:
                self.reader = reader
                published = await reader.attempts(outcome="published")
                self.metrics.seed(published[-1] if published else None)
                await self._seed_lineage(reader)
                await self._resolve()
                self.hub.reopen()
                self.hub.last_seq = await reader.last_seq()
                self.state = "ready"
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._watchdog, coord)
                    with anyio.CancelScope() as waiting:
                        tg.start_soon(self._wait_event, self._lease_lost, waiting)
                        await self._stop_requested.wait()
                    tg.cancel_scope.cancel()
                self.state = "stopping"
                await self._drain(coord)
        finally:
            self.state = "stopping" if self._stopping else "standby"
            self.hub.close()
            self.reader = None
            self.coord = None
            self.pending = None  # fenced with one waiting: the coordinator that took over recovers it
            coord.ledger.on_commit = None

    async def _seed_lineage(self, reader: Ledger) -> None:
        """Fold the ledger's lineage events before this term's first observed one into the
        metrics' lineage (`Metrics.lineage_seed`): the events observed are folded by `fold`."""
        fold, until = self.metrics.lineage_seed()
        if until is None:
            until = await reader.last_seq() + 1
        async for event in reader.read(kinds=LINEAGE_KINDS):
            if event.seq >= until:
                break
            fold.feed(event)
        self.metrics.seeded(fold)

    @staticmethod
    async def _wait_event(event: anyio.Event, scope: anyio.CancelScope) -> None:
        await event.wait()
        scope.cancel()

    async def _watchdog(self, coord: Coordinator) -> None:
        """Settle a two-step save whose deadline passed; notice a lost lease; fold the metrics."""
        while True:
            await anyio.sleep(WATCHDOG_S)
            self.metrics.fold()  # here, not in the commit hook: off the operations' path
            if not coord.ledger.writable:
                self._lease_lost.set()
                return
            pending = self.pending
            if pending is not None and self._op is None and time.time() > pending.deadline_ts:
                with contextlib.suppress(QuiesceError):  # recorded; recovery or a resume finishes it
                    await self.run("settle", self._settle, attempt_id=pending.checkpoint_id)

    async def _settle(self, coord: Coordinator) -> Any:
        """Roll back (or, once published, finish) the two-step save nobody continued in time."""
        pending = self.pending
        if pending is None:
            return None
        try:
            if pending.state in ("published",):
                return await coord.resume(pending)
            return await coord.abort(pending, reason="its caller did not publish it before its deadline")
        finally:
            self.pending = None

    async def _drain(self, coord: Coordinator) -> None:
        """Stopping: the operation in progress ends on its own; a waiting two-step save is settled."""
        with anyio.CancelScope(shield=True):
            await self._idle.wait()
            if self.pending is not None and coord.ledger.writable:
                self._op = Operation("stop", checkpoint_id=self.pending.checkpoint_id)
                try:
                    await self._settle(coord)
                except QuiesceError:
                    pass  # recorded; the next coordinator's recovery finishes it
                finally:
                    self._op = None
