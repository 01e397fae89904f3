"""Publication on the filesystem: staging, verification, manifest, atomic rename, `LATEST`, retention.

Layout:

    <snapshots>/.staging/<checkpoint_id>/      servers write here; the caller adds its half
    <snapshots>/<checkpoint_id>/manifest.json  written last (files, sizes, sha256, participants, ...)
    <snapshots>/LATEST                         the name of the latest snapshot, replaced atomically

Invariants:
- Every file and folder is durable before the staging folder is renamed (`tree_digests`: each
  file hashed and fsynced through one descriptor, many files at once — or, for a tree of
  `SYNCFS_MIN_FILES` files or more on Linux, hashed, then one `syncfs(2)` of its filesystem); the
  rename (then an fsync of `<snapshots>`) is the commit point. A crash before it leaves the
  previous snapshot latest.
- `LATEST` is written to a temporary file, fsynced, renamed over the old one, then the folder is
  fsynced: a reader sees the old or the new name, never a torn one.
- Retention never deletes the snapshot `LATEST` names, nor anything that is not a snapshot of ours
  (a folder with a `quiesce-snapshot` manifest). It may move a snapshot into `.trash/` (one
  rename) and delete it later (`empty_trash`), so the deleting runs while the servers resume.
- The ledger side (`attempt.publishing` once the manifest is written, `attempt.published` after
  the rename) is the caller's job (`save.py`); this module only touches files.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

from quiesce.coordinator.config import folder_problem
from quiesce.coordinator.digests import DigestCache, file_digest, read_facts, regular_facts
from quiesce.coordinator.durable import fsync_dir, syncfs, syncfs_available
from quiesce.coordinator.errors import SnapshotError
from quiesce.coordinator.protocol import ArtifactRef
from quiesce.ledger.canonical import canonical_text

__all__ = [
    "IN_PLACE_MANIFEST",
    "LATEST",
    "MANIFEST",
    "SNAPSHOT_FORMAT",
    "TRASH",
    "Snapshot",
    "apply_retention",
    "build_manifest",
    "discard_in_place",
    "discard_staging",
    "empty_trash",
    "fsync_dir",
    "in_place_problem",
    "in_place_roots",
    "latest_problem",
    "list_snapshots",
    "load_snapshot",
    "make_folders",
    "make_staging",
    "manifest_file_of",
    "read_latest",
    "remove_tree",
    "rename_into_place",
    "resolve_snapshot",
    "staging_problem",
    "sweep_staging",
    "tree_digests",
    "unpublishable",
    "verify_artifact",
    "verify_snapshot",
    "write_json_durably",
    "write_latest",
]

MANIFEST: Final = "manifest.json"
#: The manifest of a snapshot published in place, in a folder its caller owns (`into`): named so it
#: never meets a file of the caller's own.
IN_PLACE_MANIFEST: Final = "quiesce-manifest.json"
LATEST: Final = "LATEST"
#: Where retention moves snapshots it removes, until `empty_trash` deletes them.
TRASH: Final = ".trash"
SNAPSHOT_FORMAT: Final = "quiesce-snapshot"
_ID: Final = re.compile(r"^e(\d+)-(\d+)")
#: Threads for per-file work (hashing + fsync, removal). fsyncs issued together share the
#: filesystem's journal commits: 1,500 small files took 0.5 s one by one and 0.12 s with 32 threads.
IO_THREADS: Final = 16
#: From this many files on, `tree_digests(sync=True)` makes a tree durable with one syncfs(2) of
#: its filesystem instead of an fsync per file and folder (Linux): 1,000 small files took 0.15 s
#: of fsyncs on 16 threads and 15 ms with one syncfs. syncfs also writes back whatever else is
#: dirty on that filesystem, so a small tree keeps its own fsyncs.
SYNCFS_MIN_FILES: Final = 64
#: (size in bytes, sha256 hex) of each file, by path relative to the tree's root (posix form).
Digests = Mapping[str, tuple[int, str]]
_T = TypeVar("_T")
_R = TypeVar("_R")


def _each(fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    """``[fn(i) for i in items]`` on up to ``IO_THREADS`` threads (in order; the first error is raised)."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(IO_THREADS, len(items))) as pool:
        return list(pool.map(fn, items))


def tree_digests(
    root: Path,
    *,
    sync: bool,
    skip: Iterable[str] = (),
    cache: DigestCache | None = None,
    strict: bool = False,
) -> dict[str, tuple[int, str]]:
    """(size, sha256) of every regular file under `root` (symlinks and `skip` paths left out).

    With `strict`, an entry that cannot be published (`unpublishable`: a symlink, FIFO, socket,
    device, or a hard link to an outside file) raises `SnapshotError` naming each one, before any
    file is read.

    With `sync`, each file is fsynced as it is read and then every folder of the tree — or, from
    `SYNCFS_MIN_FILES` files on where syncfs(2) exists, the files are read and then the tree's
    filesystem is synced once: when this returns, the tree's content and entries are durable.
    A file `cache` knows unchanged is not read again (but still fsynced); files are read on
    ``IO_THREADS`` threads.
    """
    left_out = set(skip)
    odd: list[str] | None = [] if strict else None
    files = [(rel, path, st) for rel, path, st in _walk_text(root, odd=odd) if rel not in left_out]
    if odd:
        refuse_unpublishable(root, odd)
    whole_fs = sync and len(files) >= SYNCFS_MIN_FILES and syncfs_available()
    fsync = sync and not whole_fs
    sums: dict[str, tuple[int, str]] = {}
    unread: list[tuple[str, str, os.stat_result]] = []
    for rel, path, st in files:
        known = cache.get(path, st) if cache is not None else None
        if known is None or fsync:
            unread.append((rel, path, st))
        else:
            sums[rel] = (known.size, known.sha256)
    facts = _each(lambda f: read_facts(f[1], fsync=fsync, cache=cache, st=f[2]), unread)
    sums.update((rel, (fact.size, fact.sha256)) for (rel, _, _), fact in zip(unread, facts, strict=True))
    if whole_fs:
        syncfs(root)
    elif sync:
        # every folder of the tree: the parents of each file's relative path, under `root`
        folders = {root}
        for rel, _, _ in files:
            parts = rel.split("/")[:-1]
            folders.update(root.joinpath(*parts[:i]) for i in range(1, len(parts) + 1))
        _each(fsync_dir, sorted(folders))
    return {rel: sums[rel] for rel, _, _ in files}


def make_staging(staging: Path, folders: Iterable[str] = ()) -> tuple[int, int]:
    """Create `<snapshots>/.staging/<id>/` (and its parents), durably, then each of the servers'
    `folders` in it (`make_folders`: each server is handed its folder ready, as Gym's own callers
    do); returns the staging folder's identity (device, inode), which `staging_problem` checks
    before anything is published from it.

    An entry already there is taken only if it is a real folder (a retried commit); a symlink or
    anything else raises `SnapshotError`."""
    staging.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        staging.mkdir()
    found = os.lstat(staging)
    if not stat.S_ISDIR(found.st_mode):
        raise SnapshotError(
            f"the staging folder {staging} is {_special_kind(found.st_mode)}, not a folder quiesce made;"
            " remove it and save again",
            [f"{staging}: {_special_kind(found.st_mode)}"],
        )
    fsync_dir(staging.parent)
    fsync_dir(staging.parent.parent)
    for folder in sorted(set(folders)):
        make_folders(staging, folder)
    return (found.st_dev, found.st_ino)


def make_folders(staging: Path, folder: str) -> None:
    """Create `folder` (relative, checked by `folder_problem`) inside `staging`, never through a
    symlink: each part is made or found as a real folder, else `SnapshotError`."""
    here = staging
    for part in folder.split("/"):
        here = here / part
        with contextlib.suppress(FileExistsError):
            here.mkdir()
        found = os.lstat(here)
        if not stat.S_ISDIR(found.st_mode):
            raise SnapshotError(
                f"{here} is {_special_kind(found.st_mode)}, not a folder quiesce made; remove it and"
                " save again",
                [f"{here}: {_special_kind(found.st_mode)}"],
            )


def staging_problem(staging: Path, identity: tuple[int, int] | None) -> str | None:
    """Why `staging` is no longer the folder `make_staging` made (identity `identity`): gone, a
    symlink or other non-folder, or another folder put in its place. None when it is the same
    real folder (or `identity` is unknown: None)."""
    if identity is None:
        return None
    try:
        found = os.lstat(staging)
    except OSError as error:
        return f"the staging folder {staging} cannot be read: {error.strerror or error}"
    if not stat.S_ISDIR(found.st_mode):
        target = ""
        if stat.S_ISLNK(found.st_mode):
            with contextlib.suppress(OSError):
                target = f" to {os.readlink(staging)}"
        return (
            f"the staging folder {staging} was replaced by {_special_kind(found.st_mode)}{target};"
            " only the folder quiesce made is published"
        )
    if (found.st_dev, found.st_ino) != identity:
        return (
            f"the staging folder {staging} was replaced by another folder since the commit began;"
            " only the folder quiesce made is published"
        )
    return None


def remove_tree(path: Path) -> None:
    """Remove a folder if it exists (used for staging folders of rolled-back attempts). A symlink
    is removed itself, never followed: what it points at is not ours."""
    if path.is_symlink():
        with contextlib.suppress(OSError):
            path.unlink()
            fsync_dir(path.parent)
        return
    if path.exists():
        _rmtree(path)
        with contextlib.suppress(OSError):
            fsync_dir(path.parent)


def _rmtree(path: Path) -> None:
    """`shutil.rmtree(path, ignore_errors=True)`, its top-level subfolders removed on several threads."""
    with contextlib.suppress(OSError):
        children = [c for c in path.iterdir() if c.is_dir() and not c.is_symlink()]
        _each(lambda c: shutil.rmtree(c, ignore_errors=True), children)
    shutil.rmtree(path, ignore_errors=True)


def readable_json(document: Mapping[str, Any]) -> str:
    """``document`` as sorted-key JSON with one top-level key per line and one item of a list per
    line (a manifest's files and participants), each item in the ledger's canonical form
    (`canonical_text`: sorted keys, compact, UTF-8 as it is; no NaN or infinity).

    Every piece is encoded by a C encoder: ``json.dumps(indent=...)`` runs the pure-Python one
    (25 ms for the manifest of a 512-server snapshot); ``json.dumps(sort_keys=True)`` per item
    took 10 ms, the canonical encoder (orjson where its bytes are json's) 3 ms.
    """
    parts: list[str] = []
    for key in sorted(document):
        value = document[key]
        name = canonical_text(key)
        if isinstance(value, list) and value:
            items = ",\n".join("    " + canonical_text(item) for item in value)
            parts.append(f"  {name}: [\n{items}\n  ]")
        else:
            parts.append(f"  {name}: {canonical_text(value)}")
    return "{\n" + ",\n".join(parts) + "\n}" if parts else "{}"


def write_json_durably(path: Path, document: Mapping[str, Any]) -> bytes:
    """Write `readable_json(document)` via a temp file + fsync + rename + fsync of the folder.
    Returns the bytes written."""
    data = (readable_json(document) + "\n").encode("utf-8")
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return data


def verify_artifact(
    root: Path, ref: ArtifactRef, *, what: str, cache: DigestCache | None = None
) -> str | None:
    """Check one artifact reference against the file it names: bytes, sha256, record count.

    Returns a description of the first mismatch, or None. Records are the file's non-empty lines.
    A file `cache` knows unchanged since it was read is not read again.
    """
    # a symlink is not followed: the tree's digests leave symlinks out
    facts = regular_facts(root / ref.relative_path, records=True, cache=cache)
    if facts == "not a regular file":
        return f"{what}: {ref.relative_path} is missing (not a regular file)"
    if isinstance(facts, str):  # missing, or cannot be read
        return f"{what}: {ref.relative_path} {'is missing' if facts == 'missing' else facts}"
    if facts.size != ref.bytes:
        return f"{what}: {ref.relative_path} has {facts.size} bytes, the reply says {ref.bytes}"
    if facts.sha256 != ref.sha256:
        return (
            f"{what}: {ref.relative_path} sha256 {facts.sha256[:12]}… differs from the reply's"
            f" {ref.sha256[:12]}…"
        )
    if facts.records != ref.records:
        return f"{what}: {ref.relative_path} has {facts.records} records, the reply says {ref.records}"
    return None


def _walk(
    root: Path, *, links: bool = False, odd: list[str] | None = None, paths: bool = True
) -> list[tuple[str, Path, os.stat_result]]:
    """(posix path relative to `root`, path, lstat) of every regular file under `root`, sorted by
    relative path: `_walk_text` with each path as a `Path`. ``paths`` False: only `odd` is
    wanted, nothing is returned."""
    found = _walk_text(root, links=links, odd=odd)
    return [(rel, Path(path), st) for rel, path, st in found] if paths else []


def _walk_text(
    root: Path, *, links: bool = False, odd: list[str] | None = None
) -> list[tuple[str, str, os.stat_result]]:
    """(posix path relative to `root`, path as text, lstat) of every regular file under `root`,
    sorted by relative path. Symlinks are never followed, and listed only with `links`. The paths
    stay text (a `Path` per file cost a third of a 512-server snapshot's walk).

    With `odd`, a description of every entry that cannot be published is appended to it
    (`unpublishable`): a symlink, FIFO, socket or device file, or a regular file with a hard link
    outside the tree."""
    found: list[tuple[str, str, os.stat_result]] = []
    names: dict[tuple[int, int], list[str]] = {}  # (dev, ino) -> names in the tree, of files with links

    def visit(folder: str, prefix: str) -> None:
        with os.scandir(folder) as entries:
            for entry in entries:
                rel = prefix + entry.name
                if entry.is_dir(follow_symlinks=False):
                    visit(entry.path, f"{rel}/")
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    found.append((rel, entry.path, st))
                    if odd is not None and st.st_nlink > 1:
                        names.setdefault((st.st_dev, st.st_ino), []).append(rel)
                elif entry.is_symlink():
                    if links:
                        found.append((rel, entry.path, entry.stat(follow_symlinks=False)))
                    if odd is not None:
                        odd.append(f"{rel}: a symlink (to {os.readlink(entry.path)})")
                elif odd is not None:
                    odd.append(f"{rel}: {_special_kind(entry.stat(follow_symlinks=False).st_mode)}")

    visit(os.fspath(root), "")
    found.sort(key=lambda item: item[0])
    if odd is not None:
        for rel, _, st in found:
            inside = names.get((st.st_dev, st.st_ino))
            if inside is not None and st.st_nlink > len(inside) and rel == inside[0]:
                odd.append(
                    f"{rel}: a hard link to a file outside the folder ({st.st_nlink} links,"
                    f" {len(inside)} inside) — its bytes could change after publication"
                )
        odd.sort()
    return found


def _special_kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


def unpublishable(root: Path) -> list[str]:
    """Every entry under `root` that cannot be in a snapshot, described with its relative path:
    symlinks, FIFOs, sockets, device files, and regular files hard-linked to a file outside `root`
    (a snapshot's bytes must be its own: a link could change them after publication, a FIFO
    blocks whoever reads it, and a symlink may point anywhere)."""
    odd: list[str] = []
    _walk(root, odd=odd, paths=False)
    return odd


def refuse_unpublishable(root: Path, odd: list[str]) -> None:
    """Raise `SnapshotError` naming every entry of `odd` (see `unpublishable`), if any."""
    if odd:
        raise SnapshotError(
            f"{root} holds what a snapshot cannot: "
            + "; ".join(odd)
            + " — only regular files and folders are published; remove these or write real files",
            odd,
        )


def build_manifest(
    staging: Path,
    *,
    checkpoint_id: str,
    created: str,
    epoch: int,
    ledger_seq: int,
    participants: list[dict[str, Any]],
    skipped: list[dict[str, str]],
    digests: Digests | None = None,
) -> dict[str, Any]:
    """Describe every file under `staging` (size, sha256).

    `digests` must come from `tree_digests(staging, sync=True, skip=[MANIFEST])` (then every file
    and folder is already durable); without it, that is computed here.
    """
    if digests is None:
        digests = tree_digests(staging, sync=True, skip=[MANIFEST])
    files = [
        {"path": rel, "bytes": size, "sha256": digest} for rel, (size, digest) in sorted(digests.items())
    ]
    return {
        "format": SNAPSHOT_FORMAT,
        "version": 1,
        "checkpoint_id": checkpoint_id,
        "created": created,
        "epoch": epoch,
        "ledger_seq": ledger_seq,
        "participants": participants,
        "skipped": skipped,
        "files": files,
    }


def rename_into_place(staging: Path, final: Path, identity: tuple[int, int] | None = None) -> None:
    """The commit point: rename the staging folder to its final name, then fsync both parents.

    With `identity` (from `make_staging`), only that very folder is renamed (`staging_problem`)."""
    if final.exists() or final.is_symlink():
        raise SnapshotError(f"{final} already exists; refusing to overwrite a snapshot")
    problem = staging_problem(staging, identity)
    if problem is not None:
        raise SnapshotError(problem, [problem])
    os.rename(staging, final)
    fsync_dir(final.parent)
    fsync_dir(staging.parent)


def write_latest(snapshots: Path, name: str) -> None:
    """Point `LATEST` at `<snapshots>/<name>` atomically (temp + fsync + rename + fsync folder)."""
    tmp = snapshots / f".{LATEST}.{name}.tmp"
    with tmp.open("wb") as handle:
        handle.write((name + "\n").encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, snapshots / LATEST)
    fsync_dir(snapshots)


def read_latest(snapshots: Path) -> Path | None:
    """The snapshot folder `LATEST` names, or None when there is none (`latest_problem` says why)."""
    return _latest(snapshots)[0]


def latest_problem(snapshots: Path) -> str | None:
    """Why `LATEST` names no snapshot folder: missing, unreadable, not a snapshot name, naming
    nothing, or naming a symlink (never followed out of `snapshots`); None when it names one."""
    return _latest(snapshots)[1]


#: The longest `LATEST` worth reading: a snapshot name is a checkpoint id (at most 128 characters).
_LATEST_MAX_BYTES: Final = 4096


def _latest(snapshots: Path) -> tuple[Path | None, str | None]:
    where = snapshots / LATEST
    try:
        with where.open("rb") as handle:
            raw = handle.read(_LATEST_MAX_BYTES + 1)
    except FileNotFoundError:
        return None, f"{where} is missing"
    except OSError as error:
        return None, f"{where} cannot be read: {error.strerror or error}"
    if len(raw) > _LATEST_MAX_BYTES:
        return None, f"{where} is not a snapshot name (over {_LATEST_MAX_BYTES} bytes)"
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, f"{where} is not a snapshot name (not UTF-8 text)"
    if not name:
        return None, f"{where} is empty"
    shown = ascii(name[:80])
    if "/" in name or "\\" in name or name.startswith(".") or not name.isprintable():
        return None, f"{where} names {shown}, which is not a snapshot folder name"
    path = snapshots / name
    if path.is_symlink():
        return None, f"{where} names {shown}, a symlink, not a snapshot folder"
    if not path.is_dir():
        return None, f"{where} names {shown}, which does not exist"
    return path, None


def manifest_file_of(path: Path) -> Path:
    """The manifest of the snapshot at `path`: `manifest.json`, or — when only it is there — the
    `quiesce-manifest.json` of a snapshot published in place."""
    own = path / MANIFEST
    if not own.exists() and (path / IN_PLACE_MANIFEST).is_file():
        return path / IN_PLACE_MANIFEST
    return own


def in_place_roots(folders: Iterable[str]) -> list[str]:
    """The folders a snapshot published in place owns inside its caller's folder: each server's
    `folder` (`gym`, Gym's own top folder, for a server without one), none inside another."""
    tops = sorted({folder or "gym" for folder in folders})
    return [t for t in tops if not any(t.startswith(f"{o}/") for o in tops if o != t)]


def in_place_problem(into: Path, roots: Sequence[str]) -> str | None:
    """Why a save cannot be committed into `into` in place (None: it can): it must be a real
    folder or not exist yet, outside nothing quiesce owns, and hold none of the folders the
    servers will write (what is there would be mixed into the snapshot, or removed by a rollback)."""
    if into.is_symlink():
        return f"{into} is a symlink; give the folder itself"
    if into.exists() and not into.is_dir():
        return f"{into} exists and is not a folder"
    there = [r for r in roots if (into / r).exists() or (into / r).is_symlink()]
    if (into / IN_PLACE_MANIFEST).exists():
        there.append(IN_PLACE_MANIFEST)
    if there:
        return (
            f"{into} already holds {', '.join(there)}, which this save would write; give it a fresh"
            " folder (a snapshot is committed into a folder once)"
        )
    return None


def discard_in_place(into: Path, roots: Sequence[str]) -> None:
    """Roll back a save committed in place: remove what its servers wrote (`roots`), the folders
    above them left empty (up to `into`), and its manifest — never the caller's folder or anything
    else in it. Idempotent."""
    for root in roots:
        target = into / root
        if target.is_symlink():
            target.unlink()
        elif target.exists():
            remove_tree(target)
        parent = target.parent
        while parent != into and into in parent.parents:
            try:
                parent.rmdir()  # only while empty: what holds anything else is the caller's
            except OSError:
                break
            parent = parent.parent
    (into / IN_PLACE_MANIFEST).unlink(missing_ok=True)
    if into.is_dir():
        fsync_dir(into)


def discard_staging(staging: Path, roots: Sequence[str] | None) -> None:
    """Remove what a rolled-back save staged: its whole staging folder, or — committed in place
    (`roots` given) — only its servers' folders and its manifest (`discard_in_place`)."""
    if roots is None:
        remove_tree(staging)
    else:
        discard_in_place(staging, roots)


@dataclass(frozen=True)
class Snapshot:
    """A published snapshot: its folder and parsed manifest."""

    path: Path
    manifest: dict[str, Any]

    @property
    def in_place(self) -> bool:
        """Published in place, in a folder its caller owns (only `roots` are the snapshot's)."""
        return self.manifest.get("in_place") is True

    @property
    def manifest_file(self) -> Path:
        return self.path / (IN_PLACE_MANIFEST if self.in_place else MANIFEST)

    @property
    def roots(self) -> list[str]:
        """The folders of an in-place snapshot (empty for one that owns its whole folder)."""
        value = self.manifest.get("roots")
        return [r for r in value if isinstance(r, str)] if isinstance(value, list) else []

    @property
    def checkpoint_id(self) -> str:
        return str(self.manifest.get("checkpoint_id", self.path.name))

    @property
    def participants(self) -> list[dict[str, Any]]:
        value = self.manifest.get("participants", [])
        return [p for p in value if isinstance(p, dict)] if isinstance(value, list) else []

    def participant(self, name: str) -> dict[str, Any] | None:
        return next((p for p in self.participants if p.get("name") == name), None)

    @property
    def folders(self) -> dict[str, str]:
        """Each participant's folder inside the snapshot, as its publication recorded it (where it
        committed, so where it restores from, whatever the config says now), on either plane;
        absent: the top folder. `verify_snapshot` refuses one that is not a relative folder."""
        return {
            str(entry.get("name")): entry["folder"]
            for entry in self.participants
            if isinstance(entry.get("folder"), str)
        }

    def order_key(self) -> tuple[str, int, int, str]:
        """Oldest first: by creation time (snapshots of several ledgers share one folder when a
        new ledger drives the same cluster, and epochs restart at 1 in each), then epoch and seq."""
        created = self.manifest.get("created")
        when = created if isinstance(created, str) else ""
        epoch = self.manifest.get("epoch")
        seq = self.manifest.get("ledger_seq")
        if isinstance(epoch, int) and isinstance(seq, int):
            return (when, epoch, seq, self.path.name)
        match = _ID.match(self.path.name)
        if match:
            return (when, int(match.group(1)), int(match.group(2)), self.path.name)
        return (when, -1, -1, self.path.name)


def load_snapshot(path: Path) -> Snapshot:
    """Read a snapshot's manifest. Raises `SnapshotError` when it is missing or not ours."""
    manifest_file = manifest_file_of(path)
    name = manifest_file.name
    if not path.is_dir():
        raise SnapshotError(f"{path} is not a snapshot folder", [f"{path}: no such folder"])
    try:
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        raise SnapshotError(
            f"{path} has no readable {MANIFEST}: it is not a complete snapshot",
            [f"{MANIFEST}: {error}"],
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != SNAPSHOT_FORMAT:
        raise SnapshotError(
            f"{path}/{name} is not a quiesce snapshot manifest",
            [f"{name}: format is not {SNAPSHOT_FORMAT}"],
        )
    if (manifest.get("in_place") is True) != (name == IN_PLACE_MANIFEST):
        raise SnapshotError(
            f"{path}/{name} is not a quiesce snapshot manifest of its kind (in_place and its file name"
            " disagree)",
            [f"{name}: in_place is {manifest.get('in_place')!r}"],
        )
    return Snapshot(path, manifest)


def _candidates(snapshots: Path) -> int:
    """How many entries of `snapshots` `list_snapshots` would read a manifest of (folders, not
    symlinks, not hidden): at least as many as it finds snapshots. Each is one `scandir` entry,
    no manifest read."""
    if not snapshots.is_dir():
        return 0
    with os.scandir(snapshots) as entries:
        return sum(1 for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False))


def list_snapshots(snapshots: Path) -> list[Snapshot]:
    """Every readable snapshot under `snapshots`, oldest first (a symlink is never one of ours)."""
    found: list[Snapshot] = []
    if not snapshots.is_dir():
        return found
    for child in snapshots.iterdir():
        if child.name.startswith(".") or child.is_symlink() or not child.is_dir():
            continue
        if not (child / MANIFEST).is_file():
            continue
        try:
            found.append(load_snapshot(child))
        except SnapshotError:
            continue
    return sorted(found, key=Snapshot.order_key)


def resolve_snapshot(snapshots: Path, which: str | os.PathLike[str] | None) -> Path:
    """`None` / "latest" → the folder `LATEST` names; a bare name (a snapshot id) → `<snapshots>/<id>`
    when that exists, else a folder of that name in the current folder; anything else is a path.

    An id is looked up under `snapshots` first, so a folder of the same name in the current folder
    never stands in for the published snapshot. Raises `SnapshotError` when a bare name is neither.
    """
    if which is None or str(which) == "latest":
        latest, problem = _latest(snapshots)
        if latest is None:
            assert problem is not None
            missing = problem.endswith(" is missing")
            raise SnapshotError(
                f"no latest snapshot under {snapshots} (no {LATEST} file); take a checkpoint first or name"
                " a snapshot folder"
                if missing
                else f"no latest snapshot under {snapshots}: {problem}. Name a snapshot id or folder"
                " (`quiesce snapshots` lists them); the next published save rewrites it",
                [problem],
            )
        return latest
    path = Path(which)
    if len(path.parts) == 1 and not path.is_absolute() and str(path) not in (".", ".."):
        if (snapshots / path).is_dir():
            return snapshots / path
        if not path.is_dir():
            raise SnapshotError(
                f"no snapshot {str(path)!r} under {snapshots} (`quiesce snapshots` lists them), and no"
                f" folder {str(path)!r} here; name a snapshot id, `latest`, or a snapshot folder's path",
                [f"{snapshots / path}: missing"],
            )
    return path.resolve()


def verify_snapshot(path: Path, *, participants: Mapping[str, str]) -> Snapshot:
    """Check a snapshot before any server is contacted; raise `SnapshotError` listing every difference.

    Checks: every listed file exists with its size and sha256; no unlisted files, and nothing a
    snapshot never holds (`unpublishable`: symlinks, FIFOs, sockets, devices, outside hard links);
    each participant's own manifest has the digest its commit reply gave; the participant set
    (name → component) equals `participants` (the cluster's current discovery).
    """
    snapshot = load_snapshot(path)
    differences: list[str] = []
    listed: dict[str, dict[str, Any]] = {}
    for entry in snapshot.manifest.get("files", []):
        if isinstance(entry, dict) and isinstance(entry.get("path"), str):
            listed[entry["path"]] = entry
    roots = snapshot.roots
    if snapshot.in_place:
        bad = [r for r in roots if folder_problem(r) is not None]
        differences.extend(f"root {ascii(r)[:90]}: not a relative folder of plain names" for r in bad)
        roots = [r for r in roots if r not in bad]
        outside = [
            rel
            for rel in listed
            if not any(rel.startswith(f"{r}/") for r in roots) or {".", "..", ""} & set(rel.split("/"))
        ]
        differences.extend(f"{ascii(rel)[:90]}: listed outside the snapshot's folders" for rel in outside)
        for rel in outside:
            del listed[rel]
    present = sorted(rel for rel in listed if (path / rel).is_file() and not (path / rel).is_symlink())
    sums = dict(zip(present, _each(file_digest, [path / rel for rel in present]), strict=True))
    for rel, entry in sorted(listed.items()):
        if rel not in sums:
            differences.append(f"{rel}: missing")
            continue
        size, digest = sums[rel]
        if size != entry.get("bytes"):
            differences.append(f"{rel}: {size} bytes, the manifest says {entry.get('bytes')}")
        elif digest != entry.get("sha256"):
            differences.append(f"{rel}: sha256 differs from the manifest")
    odd: list[str] = []
    if snapshot.in_place:  # only the snapshot's own folders: the rest of the folder is its caller's
        walked: list[tuple[str, Path, os.stat_result]] = []
        for root in roots:
            if (path / root).is_dir() and not (path / root).is_symlink():
                inner: list[str] = []
                walked.extend(
                    (f"{root}/{rel}", p, st) for rel, p, st in _walk(path / root, links=True, odd=inner)
                )
                odd.extend(f"{root}/{entry}" for entry in inner)
            else:
                differences.append(f"{root}: missing (or not a folder)")
    else:
        walked = _walk(path, links=True, odd=odd)
    odd_paths = {entry.split(": ", 1)[0] for entry in odd}
    for rel, _, _ in walked:
        if rel not in (MANIFEST, IN_PLACE_MANIFEST) and rel not in listed and rel not in odd_paths:
            differences.append(f"{rel}: not listed in the manifest")
    differences.extend(f"{entry}, which a snapshot never holds" for entry in odd)
    recorded = {str(p.get("name")): str(p.get("component")) for p in snapshot.participants}
    for name in sorted(set(recorded) - set(participants)):
        differences.append(f"participant {name}: in the snapshot but not a participant of this cluster")
    for name in sorted(set(participants) - set(recorded)):
        differences.append(f"participant {name}: a participant of this cluster but not in the snapshot")
    for name in sorted(set(recorded) & set(participants)):
        if recorded[name] != participants[name]:
            differences.append(
                f"participant {name}: is a {participants[name]} now, the snapshot has a {recorded[name]}"
            )
    for entry in snapshot.participants:
        folder = entry.get("folder")
        if folder is not None and not (isinstance(folder, str) and folder_problem(folder) is None):
            differences.append(
                f"participant {entry.get('name')}: its folder {ascii(folder)[:90]} is not a relative"
                " folder of plain names inside the snapshot"
            )
        own = entry.get("manifest")
        own_digest = entry.get("manifest_digest")
        if (
            isinstance(own, str)
            and isinstance(own_digest, str)
            and own in listed
            and listed[own].get("sha256") != own_digest
        ):
            differences.append(
                f"participant {entry.get('name')}: {own} is not the manifest its commit reported"
                " (sha256 differs from the commit's manifest_digest)"
            )
    if differences:
        raise SnapshotError(
            f"snapshot {path} cannot be restored into this cluster:\n  " + "\n  ".join(differences),
            differences,
        )
    return snapshot


def apply_retention(
    snapshots: Path, keep: int, *, protect: Iterable[Path] = (), defer_delete: bool = False
) -> list[Path]:
    """Remove all but the newest `keep` snapshots (never a protected one, never LATEST's). Returns removed.

    With `defer_delete`, each is only renamed into `<snapshots>/.trash/` (one rename: it is no
    longer a snapshot at once) and `empty_trash` deletes it later — off the path of whoever waits.
    """
    if keep >= 0 and _candidates(snapshots) <= keep:
        return []  # no more folders than `keep` could be snapshots: no manifest needs reading
    protected = {p.resolve() for p in protect}
    latest = read_latest(snapshots)
    if latest is not None:
        protected.add(latest.resolve())
    all_snapshots = list_snapshots(snapshots)
    doomed = all_snapshots[: max(0, len(all_snapshots) - keep)]
    removed: list[Path] = []
    trash = snapshots / TRASH
    for snapshot in doomed:
        if snapshot.path.resolve() in protected:
            continue
        if defer_delete:
            trash.mkdir(exist_ok=True)
            os.replace(snapshot.path, trash / f"{snapshot.path.name}-{os.urandom(4).hex()}")
        else:
            _rmtree(snapshot.path)
        removed.append(snapshot.path)
    if removed:
        fsync_dir(snapshots)
    return removed


def empty_trash(snapshots: Path) -> int:
    """Delete what `apply_retention(defer_delete=True)` moved to `<snapshots>/.trash/`; returns how
    many folders. Best effort, never raises: what it cannot delete now is deleted next time (a
    crash in between only leaves more to delete)."""
    trash = snapshots / TRASH
    try:
        doomed = [p for p in trash.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:  # no trash (nothing was removed), or unreadable: next time
        return 0
    if doomed and not _rm_rf(doomed):
        _each(_rmtree, [p for p in doomed if p.exists()])
    if doomed:
        with contextlib.suppress(OSError):
            fsync_dir(trash)
    return len(doomed)


@functools.cache
def _rm_binary() -> str | None:
    return shutil.which("rm")


def _rm_rf(paths: Sequence[Path]) -> bool:
    """Delete `paths` with `rm -rf` in a child process; whether it ran and succeeded.

    A child process deletes on another core without ever taking this interpreter's lock, which
    the event loop needs while the servers resume: deleting a 512-server snapshot (1,500 entries)
    on threads here cost the resume round about a third of its time. Where there is no `rm`, or
    it fails, the caller deletes on threads.
    """
    rm = _rm_binary()
    if rm is None:
        return False
    try:
        done = subprocess.run(
            [rm, "-rf", "--", *(str(p) for p in paths)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
    except OSError:
        return False
    return done.returncode == 0


def sweep_staging(staging_root: Path, finished: Iterable[str]) -> list[Path]:
    """Remove the staging folders of finished attempts (by checkpoint id). Returns what was removed."""
    if not staging_root.is_dir():
        return []
    done = set(finished)
    removed: list[Path] = []
    for child in staging_root.iterdir():
        if child.is_dir() and child.name in done:
            _rmtree(child)
            removed.append(child)
    if removed:
        fsync_dir(staging_root)
    return removed
