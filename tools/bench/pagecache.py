"""Cold caches for the bench: a ledger's files dropped from the kernel's page cache, and proof they are.

How a ledger is made cold (`evict`): each of its files (the database, and its `-wal` and `-shm`
when present) is fdatasynced — a dirty page cannot be dropped — and then advised away with
`posix_fadvise(POSIX_FADV_DONTNEED)` over its whole length, which makes the kernel drop every clean
cached page of that file. It needs no privilege and touches nothing else on the machine (unlike
writing to `/proc/sys/vm/drop_caches`, which empties every cache of every process). The interpreter,
quiesce's own code and the libraries stay cached: a cold pass measures a ledger read from disk, not
a machine after a reboot.

The advice is only advice (a tmpfs, for one, keeps its pages: they are the storage), so a cold run
is only called cold when `resident` — mincore(2) over a fresh read-only mapping of the file, which
reports without faulting anything in — finds at most `COLD_MAX` of its pages still cached. A
measure records the fraction it found before each cold run and refuses a run that was not cold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

#: A cold run starts with at most this fraction of the ledger's pages in the page cache.
COLD_MAX = 0.02

_PROT_READ = 0x1
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


class NotCold(RuntimeError):
    """The kernel kept a file's pages cached after the advice (e.g. the file is on a tmpfs)."""


def ledger_files(database: Path) -> list[Path]:
    """A SQLite ledger's files that exist: the database, its write-ahead log and its shared index."""
    candidates = [database, Path(f"{database}-wal"), Path(f"{database}-shm")]
    return [path for path in candidates if path.exists()]


def _pages(path: Path) -> tuple[int, int]:
    """(resident pages, pages) of ``path``'s contents in the page cache."""
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    page = mmap.PAGESIZE
    count = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if address is None or address == _MAP_FAILED:
            error = ctypes.get_errno()
            raise OSError(error, f"mmap of {path}: {os.strerror(error)}")
        try:
            vector = (ctypes.c_ubyte * count)()
            if _libc.mincore(address, size, vector) != 0:
                error = ctypes.get_errno()
                raise OSError(error, f"mincore of {path}: {os.strerror(error)}")
            return sum(byte & 1 for byte in vector), count
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)


def resident(paths: Iterable[Path]) -> float:
    """The fraction of the pages of ``paths`` (together) that the page cache holds now; 0.0 for
    files without pages."""
    held = total = 0
    for path in paths:
        resident_pages, pages = _pages(path)
        held, total = held + resident_pages, total + pages
    return held / total if total else 0.0


def evict(paths: Iterable[Path]) -> float:
    """Drop ``paths`` from the page cache (see the module docstring); the fraction still resident
    afterwards, which must be at most ``COLD_MAX`` (else ``NotCold``, naming the files)."""
    chosen = list(paths)
    for path in chosen:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    left = resident(chosen)
    if left > COLD_MAX:
        names = ", ".join(str(p) for p in chosen)
        raise NotCold(
            f"{left:.0%} of the pages of {names} stayed in the page cache after POSIX_FADV_DONTNEED"
            " (a tmpfs keeps them): run the bench with its work and cache folders on a disk"
        )
    return left
