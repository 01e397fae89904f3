"""The published snapshots of a snapshots folder: listing them, and pruning the old ones.

A *quiesce snapshot* is a real folder (not a symlink) directly under the snapshots folder, whose
name does not start with ``.``, holding a ``manifest.json`` of format ``quiesce-snapshot``
(`publish.load_snapshot`). Nothing else is ever listed or touched: not ``.staging`` (saves in
progress), not ``.trash``, not ``LATEST``, not a folder of someone else's.

Pruning keeps the newest `keep` snapshots (in publication order: epoch, then ledger seq) and the
one ``LATEST`` names, whatever its age. Each one removed is first renamed into ``.trash`` (one
rename: from then on it is no snapshot, so a crash mid-delete leaves no half snapshot behind),
then deleted. It needs no ledger and takes no writer lock: it works beside a running coordinator,
whose own retention (`keep_latest`) follows the same rules.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quiesce.coordinator.publish import (
    MANIFEST,
    Snapshot,
    apply_retention,
    empty_trash,
    list_snapshots,
    read_latest,
)

__all__ = ["SnapshotInfo", "list_published", "prune"]


@dataclass(frozen=True)
class SnapshotInfo:
    """One published snapshot, as its manifest describes it. `size` counts the bytes of every
    file the manifest lists, plus the manifest itself."""

    id: str
    path: Path
    created: str | None
    size: int
    files: int
    participants: tuple[str, ...]
    latest: bool

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "path": str(self.path),
            "created": self.created,
            "size": self.size,
            "files": self.files,
            "participants": list(self.participants),
            "latest": self.latest,
        }


def _info(snapshot: Snapshot, latest: Path | None) -> SnapshotInfo:
    listed = snapshot.manifest.get("files")
    files = [f for f in listed if isinstance(f, dict)] if isinstance(listed, list) else []
    size = sum(f["bytes"] for f in files if isinstance(f.get("bytes"), int))
    with contextlib.suppress(OSError):  # removed meanwhile: counted without it
        size += (snapshot.path / MANIFEST).stat().st_size
    created = snapshot.manifest.get("created")
    return SnapshotInfo(
        id=snapshot.path.name,
        path=snapshot.path,
        created=created if isinstance(created, str) else None,
        size=size,
        files=len(files),
        participants=tuple(str(p.get("name")) for p in snapshot.participants),
        latest=latest is not None and snapshot.path.resolve() == latest.resolve(),
    )


def list_published(folder: Path) -> list[SnapshotInfo]:
    """Every quiesce snapshot under `folder`, oldest first; `latest` marks the one `LATEST` names."""
    latest = read_latest(folder)
    return [_info(s, latest) for s in list_snapshots(folder)]


def prune(folder: Path, keep: int) -> list[SnapshotInfo]:
    """Remove all but the newest `keep` snapshots (`keep` >= 0), never the one `LATEST` names.
    Returns what was removed, oldest first."""
    if keep < 0:
        raise ValueError(f"keep must be >= 0, not {keep}")
    latest = read_latest(folder)
    before = {s.path: _info(s, latest) for s in list_snapshots(folder)}
    removed = apply_retention(folder, keep, defer_delete=True)
    empty_trash(folder)
    return [before[p] for p in removed if p in before]
