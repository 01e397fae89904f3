"""Small pieces shared by every reference server: rejections, notifications, durable files.

Durability rule of every commit in `tools/gymsim`: `manifest.json` is written after every data
file it names, and all of them are durable before the reply naming its `manifest_digest` is
sent. In a folder the commit itself created (a fresh staging folder: nothing reads it before
the reply) files are written in place; in one that existed already (a repeated commit), each
file is written to a temporary name and renamed into place. Where syncfs(2) exists
(Linux) the barrier before the reply is one `GroupSync` of the filesystem, shared by every
commit waiting at that moment: many servers hosted in one process (path prefixes) make their
commits durable together, as one host with one disk would, instead of an fsync per file and
folder each. Elsewhere each file is fsynced before its rename and the folder after the last
data file and after the manifest, so the manifest also reaches the disk after its files.

With syncfs the files and the manifest reach the disk together: until the reply, a power loss
may leave a manifest beside incomplete files. Nothing trusts such a folder — the coordinator
verifies every file against the manifests and fsyncs the staging tree itself before it
publishes, and rolls back (removing the folder) an attempt whose commit never answered — and
Gym's control plane v1 asks a commit only to write the manifest last.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Final

from starlette.responses import JSONResponse

from quiesce.coordinator.durable import fsync_dir, syncfs, syncfs_available
from quiesce.coordinator.protocol import ArtifactRef, sha256_hex

#: Rollout ids travel in file names and headers: same alphabet as checkpoint ids.
ROLLOUT_ID_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

#: Reply of a restore that could not verify what it was given (not named by the spec).
RESTORE_FAILED: Final = "restore_failed"
#: Reply of a commit that could not write its files (not named by the spec).
CHECKPOINT_IO_ERROR: Final = "checkpoint_io_error"
#: Reply of an unexpected server error inside a control operation.
INTERNAL_ERROR: Final = "internal_error"


class ControlRejection(Exception):
    """A control operation refused or failed: `{"error": {"code", "detail"}}` with `status`."""

    def __init__(self, code: str, detail: str, status: int = 409) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.status = status

    def response(self) -> JSONResponse:
        return error_response(self.status, self.code, self.detail)


def error_response(
    status: int, code: str, detail: str, *, key: str = "detail", headers: dict[str, str] | None = None
) -> JSONResponse:
    """The spec's rejection body; the resources data plane uses `key="message"`."""
    return JSONResponse(status_code=status, content={"error": {"code": code, key: detail}}, headers=headers)


class Notifier:
    """Wake every waiter when some state changed (a level-free broadcast, safe to create off-loop)."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self, timeout: float | None) -> None:  # noqa: ASYNC109
        """Return at the next `notify()` or after `timeout` seconds (None: no limit)."""
        if timeout is not None and timeout <= 0:
            return
        if self._event is None:
            self._event = asyncio.Event()
        event = self._event
        if timeout is None:
            await event.wait()
            return
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            return


def compact_json(value: Any) -> str:
    """Compact, key-order-preserving JSON (the spec's `continuations.jsonl` lines)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def jsonl_bytes(rows: Iterable[Any]) -> tuple[bytes, int]:
    """One compact JSON line per row; returns the bytes and the record count."""
    lines = [compact_json(row) + "\n" for row in rows]
    return "".join(lines).encode("utf-8"), len(lines)


def count_records(data: bytes) -> int:
    return sum(1 for line in data.splitlines() if line.strip())


def _replace_synced(path: Path, data: bytes, *, fsync: bool = True, in_place: bool = False) -> None:
    """Write `data` to a temporary name beside `path`, fsync it (unless `fsync=False`: the
    caller syncs the filesystem later), rename it to `path` (no folder fsync). With `in_place`
    (a folder no reader looks at yet) `data` is written to `path` itself."""
    tmp = path if in_place else path.with_name(f".{path.name}.tmp-{os.getpid()}")
    # os-level calls: the same file as open(tmp, "wb") gives, without its isatty/fstat/lseek calls
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    if not in_place:
        os.replace(tmp, path)


class GroupSync:
    """Group commit of durability: `sync(path)` returns once a syncfs(2) of `path`'s filesystem
    that *started after the call* has completed. Callers that wait at the same time (threads)
    share one syncfs: the first runs it, the others wait for it or for the next one. A failed
    syncfs raises in the thread that ran it; its waiters run the next one themselves.
    One per filesystem (`for_path`)."""

    _by_device: ClassVar[dict[int, GroupSync]] = {}
    _guard: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._started = 0  #: number of the last syncfs started
        self._done = 0  #: number of the last syncfs completed
        self._running = False
        self.runs = 0  #: syncfs calls made (tests, diagnostics)

    @classmethod
    def for_path(cls, path: Path) -> GroupSync:
        device = os.stat(path).st_dev
        with cls._guard:
            group = cls._by_device.get(device)
            if group is None:
                group = cls._by_device[device] = cls()
            return group

    def sync(self, path: Path) -> None:
        with self._cond:
            ticket = self._started + 1  # the next syncfs to start: it starts after this call
            while self._done < ticket:
                if self._running:
                    self._cond.wait()
                    continue
                self._running = True
                self._started += 1
                number = self._started
                self.runs += 1
                synced = False
                self._cond.release()
                try:
                    syncfs(path)
                    synced = True
                finally:
                    self._cond.acquire()
                    self._running = False
                    if synced:
                        self._done = number
                    self._cond.notify_all()


class ArtifactWriter:
    """Writes a participant's folder inside a checkpoint dir: files first, `manifest.json` last.

    Paths handed in and recorded are relative to the checkpoint dir (POSIX, no `..`).
    Durability as the module docstring states: with syncfs, one barrier after the manifest;
    otherwise fsyncs per file, and of the folder before and after the manifest.
    """

    def __init__(self, checkpoint_dir: str, folder: str) -> None:
        self.root = Path(checkpoint_dir)
        self.folder = folder
        self.files: list[ArtifactRef] = []
        self._path = self.root / folder
        self._made = False
        self._fresh = False  #: this writer created the folder: files go in place (module docstring)
        self._renamed = False  #: a data file was added since the last folder fsync
        self._grouped = syncfs_available()  #: barriers are `GroupSync`s (else fsyncs per file/folder)

    def _dir(self) -> Path:
        if not self._made:
            try:
                self._path.mkdir(parents=True)
                self._fresh = True
            except FileExistsError:
                self._fresh = False
            self._made = True
        return self._path

    def write(self, name: str, data: bytes, records: int) -> ArtifactRef:
        relative = f"{self.folder}/{name}"
        folder = self._dir()
        _replace_synced(folder / name, data, fsync=not self._grouped, in_place=self._fresh)
        self._renamed = True
        ref = ArtifactRef(relative_path=relative, sha256=sha256_hex(data), records=records, bytes=len(data))
        self.files.append(ref)
        return ref

    def write_manifest(self, document: dict[str, Any], *, list_files: bool = True) -> str:
        """Write `manifest.json` and return its sha256. With `list_files` it names every file
        written before (`files`); without, `document` names them in its own layout."""
        body = dict(document)
        if list_files:
            body["files"] = [ref.model_dump(mode="json") for ref in self.files]
        data = (json.dumps(body, sort_keys=True) + "\n").encode("utf-8")  # C encoder: no indent
        folder = self._dir()
        if self._grouped:
            _replace_synced(folder / "manifest.json", data, fsync=False, in_place=self._fresh)
            GroupSync.for_path(folder).sync(folder)  # data files and manifest, before the reply
        else:
            if self._renamed:
                fsync_dir(folder)
            _replace_synced(folder / "manifest.json", data, in_place=self._fresh)
            fsync_dir(folder)
        self._renamed = False
        return sha256_hex(data)


def manifest_bytes(checkpoint_dir: str, folder: str) -> bytes:
    """The bytes of `<checkpoint_dir>/<folder>/manifest.json`; `ControlRejection(restore_failed)`
    when it is missing or cannot be read."""
    try:
        return (Path(checkpoint_dir) / folder / "manifest.json").read_bytes()
    except FileNotFoundError as exc:
        raise ControlRejection(RESTORE_FAILED, f"no manifest at {folder}/manifest.json") from exc
    except OSError as exc:
        raise ControlRejection(RESTORE_FAILED, f"unreadable manifest {folder}/manifest.json: {exc}") from exc


def read_manifest(checkpoint_dir: str, folder: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Read `<folder>/manifest.json` and every file it names, verifying sizes and sha256 first.

    Raises `ControlRejection(restore_failed)` naming the first problem; nothing is
    installed by the caller unless every digest matched.
    """
    root = Path(checkpoint_dir)
    try:
        manifest = json.loads(manifest_bytes(checkpoint_dir, folder))
    except ValueError as exc:
        raise ControlRejection(RESTORE_FAILED, f"unreadable manifest {folder}/manifest.json: {exc}") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise ControlRejection(RESTORE_FAILED, f"{folder}/manifest.json has no file list")
    contents: dict[str, bytes] = {}
    for raw in manifest["files"]:
        try:
            ref = ArtifactRef.model_validate(raw)
        except ValueError as exc:
            raise ControlRejection(RESTORE_FAILED, f"bad file entry in {folder}/manifest.json") from exc
        try:
            data = (root / ref.relative_path).read_bytes()
        except OSError as exc:
            raise ControlRejection(RESTORE_FAILED, f"missing file {ref.relative_path}") from exc
        if len(data) != ref.bytes or sha256_hex(data) != ref.sha256:
            raise ControlRejection(RESTORE_FAILED, f"digest mismatch for {ref.relative_path}")
        contents[ref.relative_path] = data
    return manifest, contents


def parse_call_number(call_id: str | None) -> int | None:
    """`call-7` → 7, None → 0; anything else → None (not an id this server issues)."""
    if call_id is None:
        return 0
    match = re.fullmatch(r"call-([1-9][0-9]*)", call_id)
    return int(match.group(1)) if match else None
