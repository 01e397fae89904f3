"""quiesce's backend in a process of its own — an async Ray actor — and the driver's handle on it.

`CheckpointHost` holds one `QuiesceEnvironmentCheckpoint`; make it an actor with
`ray.remote(max_restarts=N)(CheckpointHost)`. `RemoteEnvironmentCheckpoint(handle)` gives the
driver RL's `EnvironmentCheckpoint` over that actor.

Rules:

- A snapshot's block spans several calls (`begin`, `check`, `finish` | `abort`), but the
  coordinator's save is one task's context (its renewals run in a task group): the host runs each
  snapshot in a task of its own, which `begin` starts and waits on until the servers are
  committed, and which `finish` / `abort` let go on. One snapshot at a time; a call naming another
  checkpoint id is refused (`invariant`).
- A host whose process was killed and restarted by Ray (`max_restarts`) recovers from the ledger
  before it answers anything (its backend's `start`): an attempt the dead process left open is
  rolled back or finished first. The ledger must be one the restarted process reaches
  (PostgreSQL, or SQLite on storage it sees).
- The cut never crosses processes: the driver checks that RL's cut is held and reads the episodes
  RL has in flight (`expected`, or the cut's `episodes`), then the host compares them with what it
  committed. Results and errors pickle (`quiesce.rl.episodes`, `EnvironmentCheckpointError`).
- Ray is imported by neither class: the host is a plain class Ray wraps, and the handle's methods
  are awaited as Ray's object refs are.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from quiesce.coordinator import ClusterConfig
from quiesce.rl.backend import Expected, QuiesceEnvironmentCheckpoint, QuiesceEnvironmentSnapshot, read_cut
from quiesce.rl.episodes import Episode, FrozenMap, RestoredRollouts, sorted_episodes
from quiesce.rl.errors import EnvironmentCheckpointError

__all__ = ["CheckpointHost", "RemoteEnvironmentCheckpoint", "SnapshotInfo"]


@dataclass(frozen=True)
class SnapshotInfo:
    """What `begin` tells the driver of a committed snapshot (picklable)."""

    checkpoint_id: str
    path: str
    plane: str
    episodes: tuple[Episode, ...]
    restarts: tuple[Episode, ...]
    by_instance: Mapping[str, tuple[Episode, ...]]


class _Running:
    """One snapshot's task and the signals between it and the calls that drive it."""

    def __init__(self) -> None:
        self.entered: asyncio.Future[QuiesceEnvironmentSnapshot] = asyncio.get_running_loop().create_future()
        self.leave: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[None] | None = None


class CheckpointHost:
    """The backend, hosted (module docstring). `config`: a `ClusterConfig` or the path of a cluster
    config file the host's process can read."""

    def __init__(
        self,
        config: ClusterConfig | str | os.PathLike[str],
        *,
        token: str | None = None,
        deadline_s: float | None = None,
    ) -> None:
        self._backend = QuiesceEnvironmentCheckpoint(config, token=token, deadline_s=deadline_s)
        self._running: tuple[str, _Running] | None = None

    async def start(self) -> dict[str, Any]:
        """Open the backend (recovery first); what recovery did: `{"attempts": [{checkpoint_id,
        action}]}`."""
        report = await self._backend.start()
        attempts = (
            []
            if report is None
            else [{"checkpoint_id": a.checkpoint_id, "action": a.action} for a in report.attempts]
        )
        return {"attempts": attempts}

    async def begin(self, path: str) -> SnapshotInfo:
        """Enter a snapshot into `path`: every server prepared and committed when this returns."""
        await self._backend.start()
        if self._running is not None:
            raise EnvironmentCheckpointError(
                f"snapshot {self._running[0]} is still open in this host; finish or abort it first",
                operation="snapshot",
                code="invariant",
                transient=False,
            )
        running = _Running()
        running.task = asyncio.get_running_loop().create_task(self._run(path, running))
        try:
            snap = await asyncio.shield(running.entered)
        except BaseException:
            await asyncio.gather(running.task, return_exceptions=True)
            raise
        self._running = (snap.checkpoint_id, running)
        return SnapshotInfo(
            snap.checkpoint_id,
            str(snap.path),
            snap.plane,
            snap.episodes,
            snap.restarts,
            FrozenMap(snap.by_instance),
        )

    async def _run(self, path: str, running: _Running) -> None:
        """The snapshot's own task: enter, wait to be told how to leave, leave that way."""
        try:
            async with self._backend.snapshot(path) as snap:
                running.entered.set_result(snap)
                reason = await running.leave
                if reason is not None:
                    raise EnvironmentCheckpointError(
                        f"checkpoint {snap.checkpoint_id} aborted by the driver: {reason}",
                        operation="snapshot",
                        code="aborted",
                        transient=False,
                    )
        except BaseException as error:
            if not running.entered.done():
                running.entered.set_exception(error)
                return
            raise

    def _take(self, checkpoint_id: str) -> _Running:
        if self._running is None or self._running[0] != checkpoint_id:
            open_id = self._running[0] if self._running is not None else None
            raise EnvironmentCheckpointError(
                f"no snapshot {checkpoint_id} is open in this host"
                + (f" (snapshot {open_id} is)" if open_id else "")
                + "; a host restarted since begin() recovered it from the ledger already",
                operation="snapshot",
                code="invariant",
                transient=False,
            )
        return self._running[1]

    async def check(self, checkpoint_id: str, episodes: Iterable[Any]) -> None:
        """Compare the episodes RL has in flight (read at the cut by the driver) with what this
        snapshot committed (`QuiesceEnvironmentSnapshot.compare`)."""
        running = self._take(checkpoint_id)
        running.entered.result().compare(sorted_episodes(episodes, "the episodes RL has in flight"))

    async def finish(self, checkpoint_id: str) -> None:
        """Leave the snapshot: publish in place, resume every server."""
        await self._leave(checkpoint_id, None)

    async def abort(self, checkpoint_id: str, reason: str) -> None:
        """Leave the snapshot rolled back (RL's block failed); raises nothing for the abort itself."""
        with contextlib.suppress(EnvironmentCheckpointError):
            await self._leave(checkpoint_id, reason or "the driver's block failed")

    async def _leave(self, checkpoint_id: str, reason: str | None) -> None:
        running = self._take(checkpoint_id)
        running.leave.set_result(reason)
        try:
            assert running.task is not None
            await running.task
        finally:
            self._running = None

    async def restore(self, path: str) -> RestoredRollouts:
        """Restore the snapshot in `path` (`QuiesceEnvironmentCheckpoint.restore`)."""
        return await self._backend.restore(path)

    async def discard_restored(self, restored: RestoredRollouts) -> None:
        await self._backend.discard_restored(restored)

    async def close(self) -> None:
        """Abort an open snapshot, close the backend."""
        if self._running is not None:
            await self.abort(self._running[0], "the host is closing")
        await self._backend.aclose()


class RemoteSnapshot:
    """RL's `EnvironmentSnapshot` on the driver, for a snapshot a `CheckpointHost` holds."""

    def __init__(self, handle: Any, info: SnapshotInfo, expected: Expected | None) -> None:
        self._handle = handle
        self.info = info
        self.checkpoint_id = info.checkpoint_id
        self.episodes = info.episodes
        self.restarts = info.restarts
        self._expected = expected

    async def check_against_cut(self, cut: Any) -> None:
        """The cut's liveness and RL's episodes are read here (`read_cut`); the host compares."""
        episodes = await read_cut(self.checkpoint_id, cut, self._expected)
        await self._handle.check.remote(self.checkpoint_id, list(episodes))


class RemoteEnvironmentCheckpoint:
    """RL's `EnvironmentCheckpoint` on the driver over a `CheckpointHost` actor `handle`."""

    def __init__(self, handle: Any, *, expected: Expected | None = None) -> None:
        self._handle = handle
        self._expected = expected

    @asynccontextmanager
    async def snapshot(self, path: str | os.PathLike[str]) -> AsyncIterator[RemoteSnapshot]:
        """`begin` in the host; yield; `finish` on leaving, `abort` if the block raised (RL's
        exception propagates unchanged)."""
        info: SnapshotInfo = await self._handle.begin.remote(os.fspath(path))
        try:
            yield RemoteSnapshot(self._handle, info, self._expected)
        except BaseException as error:
            with contextlib.suppress(Exception):
                await self._handle.abort.remote(info.checkpoint_id, f"{type(error).__name__}: {error}"[:500])
            raise
        await self._handle.finish.remote(info.checkpoint_id)

    async def restore(self, path: str | os.PathLike[str]) -> RestoredRollouts:
        restored: RestoredRollouts = await self._handle.restore.remote(os.fspath(path))
        return restored

    async def discard_restored(self, restored: RestoredRollouts) -> None:
        await self._handle.discard_restored.remote(restored)
