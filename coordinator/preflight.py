"""The preflight of a save: what the filesystem must allow before any server is paused.

A save that cannot publish should fail before it pauses anyone, not after every server waited for
it. `preflight(config)` runs before the attempt starts (nothing recorded, nothing called) and
raises `SnapshotError` saying what is wrong and what to do when:

- the snapshots folder cannot be made: it is created if missing, but never its parent (a typo, or
  a mount that is not there, must not become a new folder on another disk);
- a file cannot be created in it and in its staging folder (a read-only filesystem or folder, a
  full disk, no permission) — probed for real, since permission bits say nothing to root;
- the staging folder and the snapshots folder are on different filesystems: publication is one
  `rename(2)`, which cannot cross filesystems.

It returns warnings (never fatal): free space on that filesystem below the size of the latest
snapshot, which the next one will likely need again.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Final

from quiesce.coordinator.config import ClusterConfig
from quiesce.coordinator.errors import SnapshotError
from quiesce.coordinator.publish import MANIFEST, read_latest

__all__ = ["preflight", "remember_snapshot_bytes", "snapshot_bytes"]

_PROBE = ".quiesce-preflight"


def _fail(config: ClusterConfig, what: str) -> SnapshotError:
    return SnapshotError(
        f"cannot save into {config.snapshots}: {what}. Nothing was paused; fix this (or change `snapshots:`"
        " in the config) and run the checkpoint again",
        [what],
    )


def _os_reason(error: OSError) -> str:
    if error.errno == errno.EROFS:
        return "its filesystem is read-only"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full"
    if error.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied ({error.strerror})"
    return error.strerror or str(error)


#: snapshot folder → (its manifest's stat identity, the bytes it lists): what a save published
#: here (`remember_snapshot_bytes`) or a preflight read, so the next preflight does not parse that
#: manifest again while the file is the one it was (a rewrite changes its identity)
_KNOWN_BYTES: dict[str, tuple[tuple[int, int, int, int, int], int]] = {}
_KNOWN_MAX: Final = 16


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _keep_bytes(snapshot: Path, st: os.stat_result, total: int) -> None:
    if len(_KNOWN_BYTES) >= _KNOWN_MAX:
        _KNOWN_BYTES.clear()
    _KNOWN_BYTES[str(snapshot)] = (_identity(st), total)


def remember_snapshot_bytes(snapshot: Path, total: int) -> None:
    """Note that the snapshot just published at `snapshot` lists `total` bytes (its manifest as it
    is now on disk), for the next preflight's `snapshot_bytes`."""
    try:
        st = os.stat(snapshot / MANIFEST)
    except OSError:
        return
    _keep_bytes(snapshot, st, total)


def snapshot_bytes(snapshot: Path) -> int:
    """The bytes a published snapshot's manifest lists (0 when it cannot be read); a manifest
    unchanged since this process published or read it is not parsed again."""
    from quiesce.coordinator.publish import load_snapshot

    try:
        st: os.stat_result | None = os.stat(snapshot / MANIFEST)
    except OSError:
        st = None
    known = _KNOWN_BYTES.get(str(snapshot))
    if st is not None and known is not None and known[0] == _identity(st):
        return known[1]
    try:
        files = load_snapshot(snapshot).manifest.get("files", [])
    except SnapshotError:
        return 0
    total: int = sum(f["bytes"] for f in files if isinstance(f, dict) and isinstance(f.get("bytes"), int))
    if st is not None:
        _keep_bytes(snapshot, st, total)
    return total


def preflight(config: ClusterConfig) -> list[str]:
    """Check the snapshots folder before a save (see the module docstring); returns warnings."""
    snapshots = config.snapshots
    staging = config.staging_root
    if not snapshots.parent.is_dir():
        raise _fail(config, f"the folder {snapshots.parent} does not exist (quiesce does not create it)")
    probe = snapshots / f"{_PROBE}-{os.getpid()}-{os.urandom(4).hex()}"
    moved = staging / probe.name
    try:
        snapshots.mkdir(exist_ok=True)
        staging.mkdir(exist_ok=True)
        if not snapshots.is_dir() or not staging.is_dir():
            raise _fail(config, f"{snapshots if not snapshots.is_dir() else staging} is not a folder")
        if os.stat(snapshots).st_dev != os.stat(staging).st_dev:
            raise _fail(
                config,
                f"{staging} is on another filesystem than {snapshots}; publication is one rename, which"
                " cannot cross filesystems — unmount what is mounted there",
            )
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.close(fd)
        os.rename(probe, moved)  # a snapshot's publication is this same rename, the other way round
    except OSError as error:
        if error.errno == errno.EXDEV:
            raise _fail(config, f"{staging} and {snapshots} are on different filesystems") from None
        raise _fail(config, f"a file cannot be created there: {_os_reason(error)}") from None
    finally:
        for leftover in (probe, moved):
            with contextlib.suppress(OSError):
                leftover.unlink()
    warnings: list[str] = []
    latest = read_latest(snapshots)
    if latest is not None:
        needed = snapshot_bytes(latest)
        try:
            fs = os.statvfs(snapshots)
        except OSError:
            return warnings
        free = fs.f_bavail * fs.f_frsize
        if free < needed:
            warnings.append(
                f"only {free / 1e6:.1f} MB free on the filesystem of {snapshots}; the latest snapshot"
                f" ({latest.name}) holds {needed / 1e6:.1f} MB — this save may run out of space (it would"
                " then roll back)"
            )
    return warnings
