"""Making files durable: fsync of a folder, syncfs(2) of a filesystem. Operating-system calls only.

No coordinator logic lives here, so the reference servers (`tools/gymsim`, which stand in for Gym
servers and otherwise use nothing of the coordinator's but the wire models) share these too.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["fsync_dir", "fsync_file", "syncfs", "syncfs_available"]


def _fsync(path: str | Path, flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsync a folder so renames and new entries in it are durable."""
    _fsync(path, getattr(os, "O_DIRECTORY", 0))


def fsync_file(path: str | Path) -> None:
    """fsync a file (its data and inode) without reading it."""
    _fsync(path, 0)


@functools.cache
def _syncfs_call() -> Callable[[int], int] | None:
    """libc's syncfs(2), or None where there is none (not Linux)."""
    try:
        call = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
    except OSError:
        return None
    if call is not None:
        call.argtypes = [ctypes.c_int]
        call.restype = ctypes.c_int
    return call


def syncfs_available() -> bool:
    """Whether `syncfs` works on this system (Linux)."""
    return _syncfs_call() is not None


def syncfs(path: Path) -> None:
    """Write back everything dirty on the filesystem holding `path` (data, inodes, folders) and
    wait for it; raise `OSError` on a writeback error (Linux 5.8+ reports them). Linux only."""
    call = _syncfs_call()
    if call is None:
        raise OSError(f"syncfs(2) is not available on this system (needed for {path})")
    fd = os.open(path, os.O_RDONLY)
    try:
        if call(fd) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"syncfs: {os.strerror(errno)}", str(path))
    finally:
        os.close(fd)
