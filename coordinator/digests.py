"""What the coordinator learns by reading a server's file — size, sha256, record count — read once.

A save checks each file the servers wrote more than once: its participant's commit is verified
(manifest digest, artifact digests and record counts) before the next role group is called, and
publish hashes the whole staging tree for the snapshot manifest and checks every commit again.
`DigestCache` keeps the facts of each file read during one attempt and gives them back later
only while the file's stat identity — device, inode, size, mtime and ctime in nanoseconds — is
the one it had while it was read. Writing to a file or renaming another over it changes that
identity (the kernel sets ctime; no caller can set it back), so a file changed since it was read
is read again.

Racy files (git's "racy clean" rule): a file whose mtime or ctime is within `RACY_S` of the
moment its read began could be written again inside the same timestamp tick without its stat
changing, so its facts are not kept. Linux stamps files from a coarse clock (one tick is 1–10 ms).

Operating-system calls and hashing only; no coordinator logic.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from quiesce.coordinator.durable import fsync_file


def _regular_stat(path: str | os.PathLike[str]) -> os.stat_result | str:
    """The ``lstat`` of a regular file (never followed through a symlink); else what is wrong with
    it: ``"missing"``, ``"not a regular file"`` or ``"cannot be read: ..."``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as error:
        return f"cannot be read: {error.strerror or error}"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return st


__all__ = [
    "RACY_S",
    "DigestCache",
    "FileFacts",
    "file_digest",
    "read_facts",
    "regular_bytes",
    "regular_facts",
]

_CHUNK: Final = 1 << 20
#: A file stamped less than this before its read began is not cached (see the module docstring).
RACY_S: Final = 0.025
_RACY_NS: Final = int(RACY_S * 1e9)

_StatKey = tuple[int, int, int, int, int]
#: A file's path, as text or a `Path` (the hot paths pass text: no `Path` object per file).
StrPath = str | Path


@dataclass(frozen=True)
class FileFacts:
    """A file's size in bytes, sha256 (hex) and — when asked for — its records (non-empty lines)."""

    size: int
    sha256: str
    records: int | None = None


def _key(st: os.stat_result) -> _StatKey:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class DigestCache:
    """Facts of the files read during one attempt, by absolute path; thread-safe.

    `get` returns facts only for a file whose stat identity is unchanged since it was read;
    `put` keeps nothing for a racy file (module docstring).
    """

    def __init__(self) -> None:
        self._facts: dict[str, tuple[_StatKey, FileFacts]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._facts)

    def clear(self) -> None:
        with self._lock:
            self._facts.clear()

    def get(self, path: StrPath, st: os.stat_result) -> FileFacts | None:
        key = path if isinstance(path, str) else str(path)
        with self._lock:
            found = self._facts.get(key)
        if found is None or found[0] != _key(st):
            return None
        return found[1]

    def put(self, path: StrPath, st: os.stat_result, facts: FileFacts, read_started_ns: int) -> None:
        if max(st.st_mtime_ns, st.st_ctime_ns) > read_started_ns - _RACY_NS:
            return
        key = path if isinstance(path, str) else str(path)
        with self._lock:
            self._facts[key] = (_key(st), facts)


def _count_records(data: bytes, carry: bytes) -> tuple[int, bytes]:
    """Non-empty lines of `carry + data` before its last newline, and what follows that newline."""
    lines = (carry + data).split(b"\n")
    rest = lines.pop()
    return sum(1 for line in lines if line.strip()), rest


def read_facts(
    path: StrPath,
    *,
    records: bool = False,
    fsync: bool = False,
    cache: DigestCache | None = None,
    st: os.stat_result | None = None,
) -> FileFacts:
    """Size and sha256 of a file (and its record count with `records`), from `cache` when the file
    is unchanged since it was read, else read through one descriptor (fsynced before it is
    closed with `fsync`). `st` is the file's `os.stat` when the caller has it. Raises `OSError`."""
    if cache is not None:
        known = cache.get(path, st if st is not None else os.stat(path))
        if known is not None and (known.records is not None or not records):
            if fsync:
                fsync_file(path)
            return known
    started = time.time_ns()
    digest = hashlib.sha256()
    size = 0
    count = 0
    carry = b""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        before = os.fstat(fd)
        while chunk := os.read(fd, _CHUNK):
            digest.update(chunk)
            size += len(chunk)
            if records:
                found, carry = _count_records(chunk, carry)
                count += found
        if fsync:
            os.fsync(fd)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if records and carry.strip():
        count += 1
    facts = FileFacts(size, digest.hexdigest(), count if records else None)
    if cache is not None and _key(before) == _key(after):
        cache.put(path, after, facts, started)
    return facts


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read now."""
    facts = read_facts(path)
    return facts.size, facts.sha256


def regular_bytes(path: StrPath, *, cache: DigestCache | None = None) -> tuple[bytes, FileFacts] | str:
    """The bytes of a regular file and its facts (size, sha256), never through a symlink, read once
    through one descriptor; the facts go into `cache` by the same rules as ``read_facts`` (kept
    only when the file's stat identity did not change while it was read and it is not racy), so a
    later ``read_facts`` of the unchanged file does not read it again. Else what is wrong with it,
    as ``regular_facts`` says it."""
    st = _regular_stat(path)
    if isinstance(st, str):
        return st
    started = time.time_ns()
    chunks: list[bytes] = []
    try:
        # O_NOFOLLOW: a symlink swapped in since the lstat is refused, never followed
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            before = os.fstat(fd)
            while chunk := os.read(fd, _CHUNK):
                chunks.append(chunk)
            after = os.fstat(fd)
        finally:
            os.close(fd)
    except OSError as error:
        return f"cannot be read: {error.strerror or error}"
    if not stat.S_ISREG(before.st_mode):
        return "not a regular file"
    data = b"".join(chunks)
    facts = FileFacts(len(data), hashlib.sha256(data).hexdigest())
    if cache is not None and _key(before) == _key(after):
        cache.put(path, after, facts, started)
    return data, facts


def regular_facts(
    path: StrPath, *, records: bool = False, cache: DigestCache | None = None
) -> FileFacts | str:
    """``read_facts`` of a regular file, never through a symlink; else what is wrong with it:
    ``"missing"``, ``"not a regular file"`` (a folder, a symlink, ...) or ``"cannot be read: ..."``."""
    st = _regular_stat(path)
    if isinstance(st, str):
        return st
    try:
        return read_facts(path, records=records, cache=cache, st=st)
    except OSError as error:
        return f"cannot be read: {error.strerror or error}"
