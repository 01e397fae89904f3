"""Upkeep of a SQLite writer's WAL once an operation has ended: its disk work off the commit path.

Two pieces of disk work would otherwise fall on some later commit, inside an operation:

- the **fdatasync of the write-behind tail** — the commits made after an operation's last
  ``sync`` (a save's resume records and ``attempt.completed``) reach the disk with the next durable
  commit, which is the next operation's first, before its first request;
- the **WAL checkpoint** — SQLite's automatic one runs inside the commit that takes the WAL past
  ``wal_autocheckpoint`` pages (copying the WAL back into the database file and fsyncing both),
  several milliseconds on one commit in a dozen saves.

``WalUpkeep`` does both on a thread of its own, between operations. Rules it keeps:

- **Only once the operation is over and the writer quiet.** ``arm`` (the backend's
  ``operation_ended``: ``Ledger.sync`` once an operation has told its caller the outcome, or a
  save once its servers have resumed — it syncs its outcome while they resume, and arms only
  after) lets the thread act once nothing has come for ``QUIET_S``; every commit
  (``committed``) and every staged event (``busy``: a fan-out's replies are staged as they come)
  pushes that moment back. (Armed by the sync alone, it ran inside a 512-server save's resume,
  whose stages go tens of milliseconds without a commit.) It then fsyncs what is owed and, once
  ``CHECKPOINT_AFTER_COMMITS`` commits or ``CHECKPOINT_AFTER_EVENTS`` events have come since the
  last checkpoint, checkpoints the WAL. Both counts matter: a 4-server save is a few dozen
  one-event commits, a 512-server save about 3,000 events in a dozen group commits — some 600
  WAL pages, so counted in commits alone it would reach SQLite's automatic checkpoint inside the
  next save (seen: 6 in 10 saves, 17 ms each, on the commit path).
- **Never in a commit's way.** The checkpoint is ``PASSIVE``, on the thread's own connection: it
  waits for no reader or writer, and a writer appends while it copies older frames. The fdatasync
  is of the WAL file, which commits keep writing meanwhile.
- **Adds durability, never takes it.** What it syncs was owed anyway (to the next durable commit
  or to the close); a failed fdatasync leaves the debt in place, for the next durable commit or the
  close to pay and report (``fsync_owed``). A failed checkpoint changes nothing: the writer's own
  automatic checkpoint stays on as the backstop for a writer that is never quiet.
- **Observable.** ``settled`` waits until no round is pending or running: a benchmark waits for it
  after a timed save, so no side's background work overlaps another side's timed window.
- **Stops with the ledger.** ``stop`` ends the thread (after the work in progress) before the
  connections and the WAL's file descriptor are closed; the thread is a daemon, so a process that
  exits without closing its ledger is not held up by it.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

__all__ = ["CHECKPOINT_AFTER_COMMITS", "CHECKPOINT_AFTER_EVENTS", "QUIET_S", "WalUpkeep"]

#: How long the writer must go without a commit before the upkeep acts.
QUIET_S: Final = 0.01
#: Commits between two checkpoints: about six 4-server saves, a few hundred WAL pages — well
#: under SQLite's automatic checkpoint (1,000 pages), which then never runs inside a commit.
CHECKPOINT_AFTER_COMMITS: Final = 64
#: Events between two checkpoints, however few commits carried them: a group commit of a 512-server
#: fan-out holds hundreds (about 0.2 WAL pages each), so 1,024 events stay well under 1,000 pages.
CHECKPOINT_AFTER_EVENTS: Final = 1024
_THREAD_NAME: Final = "quiesce-wal-upkeep"


class WalUpkeep:
    """The upkeep thread of one writer (module docstring). ``committed`` is called by the writer
    after each commit, from whichever thread made it; ``arm`` and ``stop`` from any thread."""

    def __init__(self, path: Path, fsync_owed: Callable[[], None]) -> None:
        self._path = path
        self._fsync_owed = fsync_owed
        self._last_active = 0.0
        self._commits = 0
        self._events = 0
        self._checkpointed_at = 0
        self._checkpointed_events = 0
        self._armed = threading.Event()
        self._idle = threading.Event()  # no round pending or running
        self._idle.set()
        self._round_lock = threading.Lock()  # an arm and the end of a round, one at a time
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.checkpoints = 0  # checkpoints run (observed by tests and benchmarks)

    def committed(self, events: int = 1) -> None:
        """A commit of ``events`` events was made: the writer is not quiet."""
        self._last_active = time.monotonic()
        self._commits += 1
        self._events += events

    def busy(self) -> None:
        """The writer staged an event (a commit will follow): it is not quiet."""
        self._last_active = time.monotonic()

    def arm(self) -> None:
        """Tend the WAL once the writer is quiet (the thread starts at the first call)."""
        if self._stopping.is_set():
            return
        with self._round_lock:
            self._idle.clear()
            self._armed.set()
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=_THREAD_NAME, daemon=True)
                    self._thread.start()

    def settled(self, timeout_s: float) -> bool:
        """Wait (blocking) until no round is pending or running; False if ``timeout_s`` ran out."""
        return self._idle.wait(timeout_s)

    def stop(self) -> None:
        """End the thread, once the work in progress is done. Idempotent."""
        self._stopping.set()
        self._armed.set()
        with self._start_lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._idle.set()

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while True:
                self._armed.wait()
                if self._stopping.is_set():
                    return
                while (left := self._last_active + QUIET_S - time.monotonic()) > 0:
                    if self._stopping.wait(left):
                        return
                self._armed.clear()  # an arm from now on is tended by the next round
                if self._stopping.is_set():  # (`stop` may have armed just before that clear)
                    return
                self._fsync_owed()
                commits, events = self._commits, self._events
                if (
                    commits - self._checkpointed_at >= CHECKPOINT_AFTER_COMMITS
                    or events - self._checkpointed_events >= CHECKPOINT_AFTER_EVENTS
                ):
                    self._checkpointed_at, self._checkpointed_events = commits, events
                    conn = self._checkpoint(conn)
                with self._round_lock:
                    if not self._armed.is_set():
                        self._idle.set()
        finally:
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()

    def _checkpoint(self, conn: sqlite3.Connection | None) -> sqlite3.Connection | None:
        """One passive checkpoint on the thread's connection (opened on first use); the connection
        to use next time (None after a failure: the writer's automatic checkpoint still runs)."""
        try:
            if conn is None:
                conn = sqlite3.connect(self._path, isolation_level=None, timeout=0)
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error:
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            return None
        self.checkpoints += 1
        return conn
