"""The staging folder of a save: made beside the prepare phase, used by the commit.

A save into quiesce's snapshots folder needs `<snapshots>/.staging/<checkpoint id>/` and each
server's folder in it, made durably (`publish.make_staging`: two directory fsyncs) before the
first commit request. That work needs nothing from the servers, so it runs in a worker thread
beside the prepare phase (`beside_prepare`) instead of on the path between the last prepare reply
and the first commit request — and its fsyncs overlap the ledger's fsync of `attempt.started`.

Rules it keeps:

- The commit phase owns the outcome: a folder that could not be made (a symlink planted at the
  predictable path, a read-only disk) fails the *commit* phase with the same message as when it
  is made there (`made_for_commit`); the prepare phase is not failed by it.
- Nothing outlives the phase: `beside_prepare` returns (or raises) only once the thread is done,
  so a rollback that follows a failed prepare removes the folder like any other staging folder.
- No folder the ledger cannot account for survives: a crash (or a power loss before
  `attempt.started` reaches the disk) may leave a staging folder that no unfinished attempt names;
  the next recovery sweeps every such folder (`recovery._sweep`).
- A save in place (`Attempt.in_place`: the caller's folder, named at the commit and recorded
  durably before anything is created there) makes its folders in the commit phase, as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio.to_thread

from quiesce.coordinator.attempt import Attempt, PhaseFailure
from quiesce.coordinator.errors import SnapshotError
from quiesce.coordinator.publish import make_staging

__all__ = ["beside_prepare", "made_for_commit"]

_T = TypeVar("_T")


async def beside_prepare(attempt: Attempt, prepare: Callable[[], Awaitable[_T]]) -> _T:
    """Run `prepare` (the prepare phase's body) while the attempt's staging folder is made in a
    worker thread; returns (or raises) once both are done. A save in place, or one whose folder
    is already made, runs `prepare` alone."""
    if attempt.in_place or attempt.staging_dir is None or attempt.staging_identity is not None:
        return await prepare()
    failed: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_make, attempt)  # it raises nothing but a cancellation: problems are kept
        try:
            done = await prepare()
        except Exception as error:  # raised as it is once the folder is made (a group would wrap it)
            failed = error
    if failed is not None:
        raise failed
    return done


async def made_for_commit(attempt: Attempt) -> None:
    """The staging folder, made by now: the one `beside_prepare` made, else made here. A folder
    that could not be made fails the commit phase (`PhaseFailure`), naming why."""
    if attempt.staging_identity is None and attempt.staging_problem is None:
        await _make(attempt)
    if attempt.staging_problem is not None:
        raise PhaseFailure("commit", None, attempt.staging_problem)


async def _make(attempt: Attempt) -> None:
    """Make the staging folder; its identity, or what went wrong, is kept on `attempt`."""
    staging = attempt.staging_dir
    assert staging is not None
    folders = [m.folder for m in attempt.participants if m.folder]
    try:
        attempt.staging_identity = await anyio.to_thread.run_sync(make_staging, staging, folders)
    except SnapshotError as error:
        attempt.staging_problem = str(error)
    except OSError as error:
        attempt.staging_problem = f"cannot create the staging folder {staging}: {error}"
