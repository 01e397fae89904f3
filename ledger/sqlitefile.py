"""What a SQLite ledger file may be, how it is locked for writing and opened for reading.

Standard library only (the replay workers import it).

- **One name per file.** The path is resolved (``os.path.realpath``) before anything else, so a
  symlinked ledger is its target: the WAL file SQLite keeps beside it (``<target>-wal``) is the one
  the writer fsyncs. A file with more than one hard link is refused: each name would get its own
  ``-wal`` and ``-shm`` files, and writers through two names would not see each other's commits.
- **Folders are never created.** A ledger whose folder does not exist is refused; the commands
  that own their folders (``quiesce demo``, ``quiesce sim``) create them first.
- **The writer lock is the file's identity.** The writer holds an exclusive ``flock`` on the
  database file itself (its inode), kept for the ledger's lifetime and released by the kernel
  when the process dies; whatever path a second writer takes to the same file, it finds the lock.
  SQLite's own locks are POSIX record locks, which ``flock`` neither takes nor releases.
- **Read-only filesystems and full disks are readable.** A WAL database normally needs its
  ``-shm`` file created even to read; on a filesystem (or folder) nobody can write, or a disk
  too full to hold it, with nothing left in a ``-wal`` file, every commit is in the file itself
  and no writer can be adding to it (it would need the same room), so it is opened
  ``immutable``; with a ``-wal`` file holding commits it is opened read-only and SQLite uses the
  existing ``-shm``.
- Every failure is a ``LedgerError`` saying what is wrong and what to do: not a SQLite file, a
  full disk, a read-only filesystem, a missing folder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sqlite3
import stat
import time
from pathlib import Path
from typing import Final

from quiesce.ledger.errors import FencedError, LedgerError

#: The first 16 bytes of every SQLite 3 database file.
SQLITE_HEADER: Final = b"SQLite format 3\x00"


def resolve(database: str | os.PathLike[str]) -> Path:
    """The ledger file a path names: absolute, every symlink followed."""
    return Path(os.path.realpath(database))


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_stat(path: Path, st: os.stat_result, where: str) -> None:
    """Refuse anything but a regular file with one name."""
    if not stat.S_ISREG(st.st_mode):
        raise LedgerError(f"ledger {where}: {path} is {_kind(st.st_mode)}, not a SQLite database file")
    if st.st_nlink > 1:
        raise LedgerError(
            f"ledger {where}: the file {path} has {st.st_nlink} hard links. Under two names one SQLite "
            "file gets two WAL files, and two coordinators could write it at once and corrupt it. Keep "
            f"one name: remove the other links (find / -xdev -samefile {path}) or use a copy of the file"
        )


def check_header(path: Path, head: bytes, where: str) -> None:
    """Refuse a non-empty file that does not start with the SQLite header."""
    if head and head != SQLITE_HEADER:
        raise LedgerError(
            f"ledger {where}: {path} is not a SQLite database (it does not start with the SQLite header);"
            " point the ledger URL at a quiesce ledger file, or at a new file to start one"
        )


def check_folder(path: Path, where: str) -> None:
    if not path.parent.is_dir():
        raise LedgerError(
            f"ledger {where}: the folder {path.parent} does not exist. quiesce never creates the folder of"
            f" a ledger: create it (mkdir -p {path.parent}) or correct the ledger URL"
        )


def os_problem(error: OSError, path: Path, where: str, doing: str) -> LedgerError:
    """A ``LedgerError`` for an ``OSError`` raised while ``doing`` something to the ledger file."""
    code = error.errno
    if code == errno.EROFS:
        what = (
            f"{path} is on a read-only filesystem, so no coordinator can write it. Read-only commands"
            " (history, show, check, replay --verify, export, report) still work; to write, remount it"
            " read-write or copy the ledger to a writable folder"
        )
    elif code in (errno.ENOSPC, errno.EDQUOT):
        what = f"the disk holding {path} is full; free space on it, then retry"
    elif code in (errno.EACCES, errno.EPERM):
        what = f"permission denied on {path} ({error.strerror})"
    elif code == errno.ENOENT:
        what = f"{path} does not exist"
    elif code == errno.ELOOP:
        what = f"{path} is a symlink loop"
    elif code == errno.EISDIR:
        what = f"{path} is a folder, not a SQLite database file"
    else:
        what = f"{error.strerror or error} ({path})"
    return LedgerError(f"ledger {where}: cannot {doing}: {what}")


def sqlite_problem(error: sqlite3.Error | Exception, path: Path, where: str, doing: str) -> LedgerError:
    """A ``LedgerError`` for a SQLite error (from ``sqlite3`` or wrapped by SQLAlchemy)."""
    text = str(getattr(error, "orig", None) or error)
    low = text.lower()
    if "database or disk is full" in low or "disk is full" in low:
        what = f"the disk holding {path} is full ({text}); free space on it, then retry"
    elif "readonly" in low or "read-only" in low:
        what = (
            f"{path} cannot be written ({text}): its filesystem or folder is read-only. Read-only"
            " commands still work; to write, make it writable or copy the ledger to a writable folder"
        )
    elif "file is not a database" in low or "not a database" in low:
        what = f"{path} is not a SQLite database ({text}); point the ledger URL at a quiesce ledger file"
    elif "unable to open" in low:
        what = f"SQLite cannot open {path} or the -wal/-shm files beside it ({text})"
    elif "disk i/o error" in low:
        what = f"the disk holding {path} failed a read or write ({text}); is it full or read-only?"
    else:
        what = text
    return LedgerError(f"ledger {where}: {doing} failed: {what}")


def inspect_existing(path: Path, where: str) -> bool:
    """Check an existing ledger file (regular, one link, SQLite header); False when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        check_folder(path, where)
        return False
    except OSError as error:
        raise os_problem(error, path, where, "read the ledger file") from None
    check_stat(path, st, where)
    if st.st_size:
        try:
            with open(path, "rb") as handle:
                check_header(path, handle.read(len(SQLITE_HEADER)), where)
        except OSError as error:
            raise os_problem(error, path, where, "read the ledger file") from None
    return True


def writer_lock(path: Path, where: str) -> int:
    """Open (creating if need be) the ledger file and take its writer lock; returns the descriptor.

    The caller closes it (releasing the lock) only after every SQLite connection to the file is
    closed. Raises ``FencedError`` when another process holds the lock, ``LedgerError`` for a file
    that cannot be a ledger or cannot be written.
    """
    inspect_existing(path, where)  # a folder, FIFO or device is refused before it is opened
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:  # created as a symlink since it was resolved: resolve again
            raise LedgerError(
                f"ledger {where}: {path} became a symlink while opening it; open it again"
            ) from None
        raise os_problem(error, path, where, "open the ledger file for writing") from None
    try:
        st = os.fstat(fd)
        check_stat(path, st, where)
        if st.st_size:
            check_header(path, os.pread(fd, len(SQLITE_HEADER), 0), where)
        _take_lock(fd, st, path, where)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: How long a writer waits for a lock whose holder ``/proc/locks`` no longer shows, and how often
#: it tries again: such a lock is being released (its process has just died, and the kernel closes
#: a dead process's files as it reaps it), so it is free a moment later.
RELEASING_WAIT_S: Final = 1.0
_RETRY_S: Final = 0.02


def _take_lock(fd: int, st: os.stat_result, path: Path, where: str) -> None:
    """``flock`` ``fd`` exclusively, or raise ``FencedError`` naming the process that holds it.

    A lock held by a process ``/proc/locks`` shows is refused at once. One whose holder it does not
    show (the lock was released between the two looks: a writer that just died, e.g. SIGKILLed
    right before ``quiesce recover`` runs) is tried again for up to ``RELEASING_WAIT_S``; where
    ``/proc/locks`` cannot be read that is the only wait before the refusal."""
    give_up = time.monotonic() + RELEASING_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = lock_holder(st)
        if holder is not None or time.monotonic() >= give_up:
            raise FencedError(
                f"ledger {where} already has a writer (process {holder or 'unknown'} holds the writer"
                f" lock on {path}); only one coordinator may write a ledger: stop the other one, or open"
                " this ledger readonly"
            )
        time.sleep(_RETRY_S)


def release(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def lock_holder(st: os.stat_result) -> str | None:
    """The pid holding a ``flock`` on the file ``st`` describes, from ``/proc/locks`` (Linux)."""
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as handle:
            for line in handle:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a blocked waiter has "->")
                if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
                    continue
                if parts[5] == wanted:
                    return parts[4]
    except OSError:
        return None
    return None


#: Free space a reader needs beside the ledger to create the ``-shm`` index of a WAL database
#: (32 KiB) with room to spare; with less, and nothing in the WAL, it reads the file as immutable.
READER_ROOM_BYTES: Final = 256 * 1024


def read_uri(path: Path) -> str:
    """The URI a reader opens the ledger file with (see the module docstring).

    ``immutable`` (no ``-shm`` created, no locks) only when the WAL holds nothing — every commit
    is in the file itself — and the reader could not create the ``-shm`` index: a read-only
    folder or filesystem, or a disk too full for it. Otherwise ``mode=ro``."""
    uri = path.as_uri()
    try:
        wal_bytes = os.stat(f"{path}-wal").st_size
    except OSError:
        wal_bytes = 0
    if wal_bytes == 0 and (not os.access(path.parent, os.W_OK) or _no_room(path.parent)):
        return f"{uri}?immutable=1"
    return f"{uri}?mode=ro"


def _no_room(folder: Path) -> bool:
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < READER_ROOM_BYTES


def connect_reader(
    path: Path, *, timeout: float = 10.0, check_same_thread: bool = True
) -> sqlite3.Connection:
    """A read-only ``sqlite3`` connection to the ledger file (``read_uri``)."""
    return sqlite3.connect(
        read_uri(path), uri=True, timeout=timeout, isolation_level=None, check_same_thread=check_same_thread
    )
