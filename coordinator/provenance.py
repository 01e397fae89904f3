"""A snapshot checked against the ledger before a restore contacts any server.

A snapshot's own manifest lists every file with its sha256, so `verify_snapshot` finds any file
changed alone; it cannot find files and manifests rewritten together. The ledger can: publication
records the sha256 of the top manifest (`attempt.published.manifest_sha256`). `check_provenance`
runs before discovery, reading only the snapshot's manifest and the events of its checkpoint id:

- the manifest's `checkpoint_id` must be the folder's name (a snapshot is published under its id) —
  except for a snapshot published in place, in a folder its caller named: its manifest's id is the
  one looked up;
- when the ledger holds the publication of that id, the manifest's sha256 must be the recorded
  one, else `SnapshotError` naming both digests and the seq of the record;
- when it does not (a snapshot of another ledger, or copied in), nothing ties the manifest to a
  record: the returned warning says what was verified (every file against the manifest, the
  participants against the cluster) and what was not (the manifest itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import anyio.to_thread

from quiesce.coordinator.digests import file_digest
from quiesce.coordinator.errors import SnapshotError
from quiesce.coordinator.publish import IN_PLACE_MANIFEST, MANIFEST, load_snapshot
from quiesce.ledger import Ledger

__all__ = ["Provenance", "check_provenance"]


@dataclass(frozen=True)
class Provenance:
    """What the ledger says about a snapshot: `recorded_seq` of the `attempt.published` whose digest
    it matches (None: the ledger does not know it, and `warning` says what that leaves unverified)."""

    checkpoint_id: str
    manifest_sha256: str
    recorded_seq: int | None
    warning: str | None = None


async def check_provenance(ledger: Ledger, path: Path) -> Provenance:
    """Check `path`'s manifest against its folder name and against the ledger (module docstring)."""
    snapshot = await anyio.to_thread.run_sync(load_snapshot, path)
    named = snapshot.manifest.get("checkpoint_id")
    if snapshot.in_place:  # published in its caller's folder, which has the caller's name
        if not isinstance(named, str) or not named:
            raise SnapshotError(
                f"snapshot {path}: its {IN_PLACE_MANIFEST} names no checkpoint id",
                [f"{IN_PLACE_MANIFEST}: checkpoint_id {named!r}"],
            )
    elif named != path.name:
        raise SnapshotError(
            f"snapshot {path}: its manifest names checkpoint {named!r}, but the folder is {path.name!r};"
            " a snapshot is published under its own id, so this one was renamed or its manifest replaced."
            " Restore the folder its manifest names, or a snapshot you trust",
            [f"{MANIFEST}: checkpoint_id {named!r} is not the folder name {path.name!r}"],
        )
    cid = str(named)  # the folder's name, or (in place) what the manifest names
    name = snapshot.manifest_file.name
    try:
        _, digest = await anyio.to_thread.run_sync(file_digest, snapshot.manifest_file)
    except OSError as error:
        raise SnapshotError(f"snapshot {path}: cannot read its {name}: {error}") from None
    records = [e async for e in ledger.read(checkpoint_id=cid, kinds=["attempt.published"])]
    for event in records:
        if event.data.get("manifest_sha256") == digest:
            return Provenance(cid, digest, event.seq)
    if records:
        last = records[-1]
        raise SnapshotError(
            f"snapshot {path} is not the one the ledger recorded: its {name} has sha256 {digest}, the"
            f" ledger's publication of {cid} (seq {last.seq}) recorded"
            f" {last.data.get('manifest_sha256')}. Its manifest (and with it, its files) changed after"
            " publication; nothing was restored and no server was contacted",
            [f"{name}: sha256 {digest} differs from the one recorded at seq {last.seq}"],
        )
    return Provenance(
        cid,
        digest,
        None,
        warning=(
            f"snapshot {cid} was not published by this ledger ({ledger.url} holds no publication"
            f" of it): every file was checked against its manifest and its participants against this"
            f" cluster, but the manifest itself (sha256 {digest[:16]}…) could not be checked against a"
            " recorded digest — anyone who could write the folder could have rewritten both"
        ),
    )
