"""``BareLog``: the least a write-ahead log of the coordinator's events can do — a second baseline of #3.

It keeps, per event, what any hash-chained SQLite log needs: the payload's canonical JSON, the
chain hash (``quiesce.ledger.canonical``), and a row in an ``events`` table with the ledger's columns and
indexes, written by one plain transaction per append (WAL, ``synchronous=NORMAL``), with staged
events committed in the next append's transaction, the WAL fdatasynced after a commit that is
durable, and the same upkeep between operations (``quiesce.ledger.sqlite_upkeep``: the tail synced
and the WAL checkpointed once quiet) — the same transactions and fsyncs as the real ledger on the
same coordinator calls. It
does none of the rest: no payload validation, no redaction or body capping, no ``attempts``
projection, no fencing check, no group commit, no writer lock, no error handling beyond raising.

The same coordinator code run on it, the real ledger and ``NullLedger`` in one process shows how
much of the real ledger's cost is the floor of one SQLite transaction per state-changing request
on this machine.

Bench-only: nothing can read it back (reads find nothing), so it must never drive real servers.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio.to_thread
from pydantic import BaseModel

from quiesce.ledger import AppendItem, Event, utc_now
from quiesce.ledger.canonical import GENESIS_HASH, canonical_text, chain_hash, row_bytes
from quiesce.ledger.layout import MARKER_WHERE_SQLITE
from quiesce.ledger.sqlite_upkeep import WalUpkeep
from quiesce.tools.bench.nullledger import NullLedger

_DDL = (
    "CREATE TABLE events (seq INTEGER PRIMARY KEY, at TEXT NOT NULL, kind TEXT NOT NULL,"
    " checkpoint_id TEXT, server TEXT, call_id TEXT, epoch INTEGER NOT NULL, data TEXT NOT NULL,"
    " prev_hash TEXT NOT NULL, hash TEXT NOT NULL)",
    "CREATE INDEX ix_events_checkpoint_id ON events (checkpoint_id, seq)",
    f"CREATE INDEX ix_events_marker ON events (kind, seq) WHERE {MARKER_WHERE_SQLITE}",
)
_INSERT = "INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
_Row = tuple[int, str, str, str | None, str | None, str | None, int, str, str, str]


class BareLog(NullLedger):
    """A bare hash-chained SQLite event log at ``path`` (a new file); see the module docstring."""

    def __init__(self, path: Path, epoch: int = 998) -> None:
        super().__init__(epoch)
        self.url = f"bare:{path}"
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        for ddl in _DDL:
            self._conn.execute(ddl)
        self._wal = os.open(f"{path}-wal", os.O_RDONLY | os.O_CLOEXEC)
        self._prev = GENESIS_HASH
        self._staged: list[_Row] = []
        self._staged_durable = False
        self._unsynced = False  # a write-behind commit not fdatasynced yet
        self._upkeep = WalUpkeep(path, self._fsync_owed)

    def _chain(
        self,
        kind: str,
        checkpoint_id: str | None,
        server: str | None,
        call_id: str | None,
        data: Mapping[str, Any] | BaseModel,
    ) -> Event:
        payload = data.model_dump(mode="json") if isinstance(data, BaseModel) else dict(data)
        text = canonical_text(payload)
        self._seq += 1
        at, prev = utc_now(), self._prev
        digest = chain_hash(
            prev,
            row_bytes(
                seq=self._seq,
                at=at,
                kind=kind,
                checkpoint_id=checkpoint_id,
                server=server,
                call_id=call_id,
                epoch=self.epoch,
                data_text=text,
                prev_hash=prev,
            ),
        )
        seq, epoch = self._seq, self.epoch
        self._staged.append((seq, at, kind, checkpoint_id, server, call_id, epoch, text, prev, digest))
        self._prev = digest
        self._head = Event(seq, at, kind, checkpoint_id, server, call_id, epoch, payload, prev, digest)
        return self._head

    def _commit(self, durable: bool) -> None:
        rows, self._staged = self._staged, []
        durable, self._staged_durable = durable or self._staged_durable, False
        if not rows:
            return
        self._conn.execute("BEGIN IMMEDIATE")
        self._conn.executemany(_INSERT, rows)
        self._conn.execute("COMMIT")
        self._upkeep.committed(len(rows))
        self._unsynced = not durable
        if durable:
            os.fdatasync(self._wal)

    async def append(
        self,
        kind: str,
        *,
        checkpoint_id: str | None = None,
        server: str | None = None,
        call_id: str | None = None,
        data: Mapping[str, Any] | BaseModel,
        durable: bool = True,
    ) -> Event:
        event = self._chain(kind, checkpoint_id, server, call_id, data)
        self._commit(durable)
        return event

    async def stage(
        self,
        kind: str,
        *,
        checkpoint_id: str | None = None,
        server: str | None = None,
        call_id: str | None = None,
        data: Mapping[str, Any] | BaseModel,
        durable: bool = False,
    ) -> Event:
        self._staged_durable = self._staged_durable or durable
        self._upkeep.busy()  # as the real ledger's: a staged event keeps the upkeep waiting
        return self._chain(kind, checkpoint_id, server, call_id, data)

    async def flush(self) -> None:
        self._commit(False)

    def operation_ended(self) -> None:
        """As the real ledger's: the upkeep is armed."""
        self._upkeep.arm()

    async def sync(self, *, ending: bool = True) -> None:
        """As the real ledger's: staged events committed, then the WAL fdatasynced on a worker
        thread if a write-behind commit is not on disk yet; with ``ending``, the upkeep is armed."""
        self._commit(False)
        if self._unsynced:
            self._unsynced = False
            await anyio.to_thread.run_sync(os.fdatasync, self._wal)
        if ending:
            self._upkeep.arm()

    async def append_many(self, items: Sequence[AppendItem], *, durable: bool = True) -> list[Event]:
        events = [self._chain(i.kind, i.checkpoint_id, i.server, i.call_id, i.data) for i in items]
        self._commit(durable)
        return events

    async def start_epoch(self, data: Mapping[str, Any] | BaseModel) -> Event:
        return await self.append("coordinator.started", data=data)

    def stored(self) -> int:
        """How many events are committed (for the bench's sanity check)."""
        return int(self._conn.execute("SELECT count(*) FROM events").fetchone()[0])

    def upkeep_settled(self, timeout_s: float) -> bool:
        """As the real ledger's backend: wait until the upkeep has nothing pending or running."""
        return self._upkeep.settled(timeout_s)

    def _fsync_owed(self) -> None:
        """The upkeep's fdatasync, as the real ledger's: on failure the debt stays."""
        if self._unsynced:
            self._unsynced = False
            try:
                os.fdatasync(self._wal)
            except OSError:
                self._unsynced = True

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self._upkeep.stop)
        self._commit(True)
        os.close(self._wal)
        self._conn.close()


__all__ = ["BareLog"]
