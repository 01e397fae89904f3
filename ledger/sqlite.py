"""The SQLite backend: the embedded default.

- WAL journal, ``synchronous=NORMAL`` for the writer: a commit is in the WAL file (it survives
  a process crash) and checkpoints fsync the WAL before copying it back, as SQLite does.
  ``durability="full"``: a durable append is on disk when it returns — after its COMMIT, the WAL
  file is fdatasync'ed (what ``synchronous=FULL`` does at each commit, here only for the commits
  that ask for it, without switching the setting back and forth). A write-behind append
  (``durable=False``) is not fsynced; the next durable one fsyncs the same WAL file, which holds
  it too, and so does closing the ledger — or, sooner, the WAL upkeep (``sqlite_upkeep``), which
  once an operation is over (``operation_ended``) and the writer has gone quiet fsyncs the
  commits made since and checkpoints the WAL on its own thread, so neither lands inside a later
  commit.
  ``durability="process"``: nothing is fsynced but by checkpoints; survives a process crash, not
  power loss.
- The file: its path resolved (symlinks followed), never created in a missing folder, one hard
  link only, a SQLite header (``quiesce.ledger.sqlitefile``). Errors of the filesystem (full, read-only)
  and of SQLite are ``LedgerError`` messages that say what to do.
- Writership: an exclusive ``flock`` on the database file itself (its identity, whatever path
  reaches it) held for the ledger's lifetime (the kernel releases it when the process dies), plus
  ``BEGIN IMMEDIATE`` around each append.
- A readonly ledger reads through a read-only connection (``immutable`` on a read-only filesystem
  with no WAL left behind), so every read command works on a read-only copy.
- Connections: the standard library's ``sqlite3`` — one held connection for the writer, one for
  reads — each used by one thread at a time. An append is one synchronous transaction (check,
  insert, projection, commit). While commits take under ``INLINE_COMMIT_MAX_S`` on average it
  runs on the event loop's thread (a thread hop would cost as much as the commit); on a slower
  disk it runs in a worker thread, so the loop is never blocked for long.
- Schema work (alembic) goes through SQLAlchemy's ``sqlite+aiosqlite`` engine.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import anyio
import anyio.to_thread

from quiesce.ledger import sqlitefile
from quiesce.ledger.backend import (
    OPEN,
    RECORDS_ALONE_MAX,
    AttemptQuery,
    Backend,
    Batch,
    InlineAppend,
    ProjectionCache,
    RawEvent,
    apply_append,
    records_alone,
    refusal,
)
from quiesce.ledger.errors import FencedError, LedgerError
from quiesce.ledger.layout import EVENT_COLUMNS, MARKER_WHERE_SQLITE, VERSION_TABLE, indexed_kind
from quiesce.ledger.projections import COLUMNS, AttemptRow, from_columns, stored_values
from quiesce.ledger.rollout_refs import REF_KINDS, refs_of_rows
from quiesce.ledger.sqlite_reads import LineageReads
from quiesce.ledger.sqlite_upkeep import CHECKPOINT_AFTER_EVENTS, WalUpkeep
from quiesce.ledger.urls import parse, plain_sqlite_path

if TYPE_CHECKING:
    from sqlalchemy import Connection
    from sqlalchemy.engine import URL

_T = TypeVar("_T")
_EV_COLS = ", ".join(EVENT_COLUMNS)
_AT_COLS = ", ".join(COLUMNS)
_INSERT_EVENT = f"INSERT INTO events ({_EV_COLS}) VALUES ({', '.join('?' * len(EVENT_COLUMNS))})"
_PUT_ATTEMPT = f"INSERT OR REPLACE INTO attempts ({_AT_COLS}) VALUES ({', '.join('?' * len(COLUMNS))})"
_GET_ATTEMPT = f"SELECT {_AT_COLS} FROM attempts WHERE checkpoint_id = ?"
#: (checkpoint id, seq) pairs per query of ``calls_after``.
_MARKS_PER_QUERY = 500


@functools.cache
def _calls_after_sql(n: int) -> str:
    """``calls_after`` of ``n`` pairs in one statement: per pair, in order, the ``call.sent`` events
    of its id after its seq (one range of ``ix_events_checkpoint_id`` each)."""
    pairs = ", ".join(["(?, ?)"] * n)
    return (
        f"WITH m(cid, after) AS (VALUES {pairs}) SELECT (SELECT count(*) FROM events e"
        " WHERE e.checkpoint_id = m.cid AND e.seq > m.after AND e.kind = 'call.sent') FROM m"
    )


#: The ``call.sent`` events of an id in a seq range (``ix_events_checkpoint_id``: one range).
_CALLS_BETWEEN = (
    "SELECT count(*) FROM events WHERE checkpoint_id = ? AND seq > ? AND seq <= ? AND kind = 'call.sent'"
)
_UNFINISHED = f"SELECT {_AT_COLS} FROM attempts WHERE outcome IS NULL ORDER BY last_seq"
_HEAD_SEQ_EPOCH = "SELECT seq, epoch FROM events ORDER BY seq DESC LIMIT 1"
_HEAD_ROW = f"SELECT {_EV_COLS} FROM events ORDER BY seq DESC LIMIT 1"
_TAIL_ROWS = f"SELECT {_EV_COLS} FROM events ORDER BY seq DESC LIMIT ?"
_PROJECTION_LAST_SEQ = "SELECT max(last_seq) FROM attempts"
_EVENT_TRIGGERS = "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'events'"
_PUT_REF = "INSERT INTO rollout_refs (rollout_id, seq) VALUES (?, ?)"
_REF_KIND_LIST = ", ".join(f"'{kind}'" for kind in sorted(REF_KINDS))
#: A page of the events that name rollouts (through the marker index), for a rebuild of rollout_refs.
_REF_EVENTS_PAGE = (
    f"SELECT seq, kind, data FROM events WHERE kind IN ({_REF_KIND_LIST}) AND seq > ?"
    f" AND {MARKER_WHERE_SQLITE} ORDER BY seq LIMIT ?"
)
#: Parameters per statement in the reads by lists (well under SQLite's limit).
#: Appends whose commits take less than this on average run on the event loop's thread.
INLINE_COMMIT_MAX_S = 0.002


@functools.cache
def update_sql(changed: tuple[int, ...]) -> str:
    """The ``UPDATE`` of one ``attempts`` row that sets only the columns at ``changed`` (indexes into
    ``COLUMNS``, never 0: the key), then ``WHERE checkpoint_id = ?``.

    SQLite updates an index entry whenever the SET names one of its columns, even to the value it
    has: a recorded call (``calls`` and ``last_seq`` change) thus writes the table's page and
    ``last_seq``'s index page, not also ``ix_attempts_started``'s — one WAL page less per commit."""
    return f"UPDATE attempts SET {', '.join(f'{COLUMNS[i]} = ?' for i in changed)} WHERE checkpoint_id = ?"


#: Rows per statement of ``_insert_rows``: 1,000 parameters, far below SQLite's limit. A
#: ``records_alone`` batch, committed without BEGIN, must be one statement to be atomic.
_ROWS_PER_INSERT = 100
assert RECORDS_ALONE_MAX <= _ROWS_PER_INSERT


@functools.cache
def _insert_events_sql(n: int) -> str:
    """One ``INSERT`` of ``n`` events rows: a single statement, so outside a transaction it is one
    of its own, all of its rows or none (the insert-at-head trigger checks each row in order)."""
    row = f"({', '.join('?' * len(EVENT_COLUMNS))})"
    return f"INSERT INTO events ({_EV_COLS}) VALUES {', '.join([row] * n)}"


def _insert_rows(conn: sqlite3.Connection, rows: list[RawEvent]) -> None:
    """Insert ``rows`` in one statement (``executemany`` would run one per row); up to
    ``_ROWS_PER_INSERT`` rows a statement."""
    if len(rows) == 1:
        conn.execute(_INSERT_EVENT, rows[0])
        return
    for start in range(0, len(rows), _ROWS_PER_INSERT):
        part = rows[start : start + _ROWS_PER_INSERT]
        conn.execute(_insert_events_sql(len(part)), [value for row in part for value in row])


def read_last_sql(kind: str) -> str:
    """The query of ``read_last`` for ``kind``: one lookup in the marker index for an indexed kind
    (whatever the history's length); a backward scan of the seq order for a ``call.*`` or
    ``phase.*`` kind, which are nine events in ten."""
    marker = f" AND {MARKER_WHERE_SQLITE}" if indexed_kind(kind) else ""
    return f"SELECT {_EV_COLS} FROM events WHERE kind = ? AND seq < ?{marker} ORDER BY seq DESC LIMIT 1"


class _SqliteTx:
    __slots__ = ("_c", "_last")

    def __init__(self, connection: sqlite3.Connection) -> None:
        self._c = connection
        self._last = 0  # the head seq before this transaction's rows

    def head(self) -> tuple[int, int] | None:
        row = self._c.execute(_HEAD_SEQ_EPOCH).fetchone()
        return (row[0], row[1]) if row is not None else None

    def insert_after(self, last: int, rows: list[RawEvent]) -> bool:
        # No read of the head first: revision 0003's insert-at-head trigger refuses a first row
        # that is not the stored head's next seq, linked to its hash (a stricter check than the
        # seq alone). The batch's later rows are chained on the first, so a refusal comes at the
        # first row and nothing is inserted; the caller rolls the transaction back either way.
        try:
            _insert_rows(self._c, rows)
        except sqlite3.IntegrityError:
            return False
        self._last = last
        return True

    def get_attempt(self, checkpoint_id: str) -> tuple[AttemptRow, int] | None:
        found = self._c.execute(_GET_ATTEMPT, (checkpoint_id,)).fetchone()
        if found is None:
            return None
        row = from_columns(found)
        sent = self._c.execute(_CALLS_BETWEEN, (checkpoint_id, row.last_seq, self._last)).fetchone()[0]
        return row, int(sent)

    def put_attempt(self, row: AttemptRow, before: AttemptRow | None) -> None:
        values = stored_values(row)
        if before is None:
            self._c.execute(_PUT_ATTEMPT, values)
            return
        # In place, setting only the columns whose value changed: SQLite rewrites the entry of
        # every index on a column the SET names, changed or not, so naming every column would
        # write a page of each of the projection's indexes per append (see `update_sql`).
        old = stored_values(before)
        changed = tuple(i for i in range(1, len(values)) if values[i] != old[i])
        if changed:
            self._c.execute(update_sql(changed), (*[values[i] for i in changed], values[0]))

    def put_refs(self, refs: list[tuple[str, int]]) -> None:
        self._c.executemany(_PUT_REF, refs)


class SqliteBackend(LineageReads, Backend, InlineAppend):
    dialect = "sqlite"

    def __init__(self, url: str | URL, *, where: str, durability: str, readonly: bool) -> None:
        database = plain_sqlite_path(url) if isinstance(url, str) else None
        if database is None:  # a URL object, or a string only SQLAlchemy reads
            database = parse(url)[1].database
            assert database is not None
        self.where = where
        self._url = url  # as given (a new backend for the same ledger can be made from it)
        #: the ledger file, symlinks resolved: SQLite keeps its -wal and -shm beside the target
        self._path = sqlitefile.resolve(database)
        self._durability = durability
        self._readonly = readonly
        self._lock_fd: int | None = None
        self._w: sqlite3.Connection | None = None
        self._r: sqlite3.Connection | None = None
        self._wlimiter = anyio.CapacityLimiter(1)
        self._rlimiter = anyio.CapacityLimiter(1)
        self._commit_avg_s = 0.0
        self._wal_fd: int | None = None  # the WAL file, for fdatasync after a durable commit
        self._unsynced = False  # a write-behind commit since the last fdatasync ("full" only)
        self._wal_fd_lock = threading.Lock()
        #: the writer's WAL upkeep between operations (``quiesce.ledger.sqlite_upkeep``)
        self._upkeep: WalUpkeep | None = None
        self._cache = ProjectionCache()
        self._triggers: frozenset[str] | None = None  # read by the writer when it starts
        if readonly and not sqlitefile.inspect_existing(self._path, where):
            raise LedgerError(f"no ledger at {where}: the file {self._path} does not exist")

    @property
    def path(self) -> Path:
        """The ledger file (symlinks resolved)."""
        return self._path

    # -- writership ---------------------------------------------------------------------------

    async def claim_writer(self) -> None:
        self._lock_fd = sqlitefile.writer_lock(self._path, self.where)

    def _release_writer(self) -> None:
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            sqlitefile.release(fd)

    def _problem(self, error: BaseException, doing: str) -> LedgerError:
        if isinstance(error, OSError):
            return sqlitefile.os_problem(error, self._path, self.where, doing)
        return sqlitefile.sqlite_problem(error, self._path, self.where, doing)  # type: ignore[arg-type]

    # -- schema --------------------------------------------------------------------------------

    async def run_schema(self, fn: Callable[[Connection], object]) -> object:
        import aiosqlite  # schema work only
        from sqlalchemy.exc import DBAPIError
        from sqlalchemy.ext.asyncio import create_async_engine

        path, readonly = self._path, self._readonly

        async def connect() -> aiosqlite.Connection:
            if readonly:
                return await aiosqlite.connect(sqlitefile.read_uri(path), uri=True)
            return await aiosqlite.connect(str(path))

        engine = create_async_engine("sqlite+aiosqlite://", async_creator=connect)
        try:
            async with engine.begin() as conn:
                return await conn.run_sync(fn)
        except DBAPIError as error:
            raise self._problem(error, "the schema check") from None
        except OSError as error:
            raise self._problem(error, "the schema check") from None
        finally:
            await engine.dispose()

    async def quick_revision(self) -> str | None:
        if not self._path.is_file():
            return None
        try:
            conn = sqlitefile.connect_reader(self._path)
        except sqlite3.Error:
            return None
        try:
            row = conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall()
        except sqlite3.Error:
            return None
        finally:
            conn.close()
        return str(row[0][0]) if len(row) == 1 else None

    # -- connections ---------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self._path, isolation_level=None, check_same_thread=False, timeout=10.0)

    async def start(self) -> None:
        def open_all() -> None:
            if not self._readonly:
                w = self._connect()
                try:
                    mode = w.execute("PRAGMA journal_mode=WAL").fetchone()
                    if mode is None or str(mode[0]).lower() != "wal":
                        raise LedgerError(f"could not put {self.where} in WAL mode (journal_mode={mode})")
                    w.execute("PRAGMA synchronous=NORMAL")
                    self._triggers = frozenset(str(row[0]) for row in w.execute(_EVENT_TRIGGERS))
                except BaseException:
                    w.close()
                    raise
                self._w = w
                self._upkeep = WalUpkeep(self._path, self._fsync_owed)
                r = self._connect()
                r.execute("PRAGMA query_only=ON")
            else:
                r = sqlitefile.connect_reader(self._path, check_same_thread=False)
                r.execute("SELECT 1 FROM events LIMIT 1").fetchall()  # fails now, not at the first read
            self._r = r

        try:
            await anyio.to_thread.run_sync(open_all)
        except (sqlite3.Error, OSError) as error:
            raise self._problem(error, "opening the ledger") from None

    async def close(self) -> None:
        w, r = self._w, self._r
        self._w = self._r = None
        upkeep, self._upkeep = self._upkeep, None

        def close_all() -> None:
            if upkeep is not None:  # first: it may sync or checkpoint until it stops
                upkeep.stop()
            unsynced, self._unsynced = w is not None and self._unsynced, False
            try:
                if unsynced:
                    self._fsync_wal()
            finally:
                fd, self._wal_fd = self._wal_fd, None
                if fd is not None:
                    os.close(fd)
            for conn in (r, w):
                if conn is not None:
                    with contextlib.suppress(sqlite3.Error):
                        conn.close()

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(close_all)
        self._release_writer()

    # -- writes --------------------------------------------------------------------------------

    def _append_sync(self, batch: Batch) -> None:
        conn = self._w
        if conn is None:
            raise LedgerError(f"ledger {self.where} is not open for writing")
        try:
            if records_alone(batch):  # one statement, its own transaction
                try:
                    _insert_rows(conn, batch.rows)
                except sqlite3.IntegrityError:  # the insert-at-head trigger (revision 0003)
                    raise refusal(_SqliteTx(conn).head(), batch) from None
                for event in batch.events:
                    self._cache.record_alone(event)
            else:
                conn.execute("BEGIN IMMEDIATE")
                written = apply_append(_SqliteTx(conn), batch, self._cache)
                conn.execute("COMMIT")
                self._cache.committed(written)
            self._committed(durable=batch.durable, events=len(batch.rows))
        except BaseException as error:
            self._cache.clear()
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if isinstance(error, sqlite3.IntegrityError):
                raise FencedError(
                    f"ledger {self.where}: seq {batch.rows[0][0]} was taken by another writer; this "
                    "writer is fenced and must stop making calls"
                ) from None
            if isinstance(error, sqlite3.Error):
                raise self._problem(error, "append") from error
            if isinstance(error, OSError):  # committed, but the fdatasync of the WAL failed
                raise self._problem(error, "fsync the WAL") from error
            raise

    def can_append_now(self) -> bool:
        # A hop to a worker thread costs about as much as a fast commit (0.1-0.2 ms on a VM), so
        # while commits are fast they run right here, blocking the event loop for at most about
        # INLINE_COMMIT_MAX_S; once the moving average says the disk is slow, they go to a thread.
        return self._commit_avg_s <= INLINE_COMMIT_MAX_S

    def append_now(self, batch: Batch) -> None:
        # timed, here or on the writer's thread: the moving average ``can_append_now`` reads
        start = time.perf_counter()
        try:
            self._append_sync(batch)
        finally:
            self._commit_avg_s = 0.8 * self._commit_avg_s + 0.2 * (time.perf_counter() - start)

    async def append(self, batch: Batch) -> None:
        if self.can_append_now():
            self.append_now(batch)
        else:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.append_now, batch, limiter=self._wlimiter)

    async def sync(self) -> None:
        # on a worker thread of its own, not the writer's: commits go on while the WAL is synced
        # (a commit made meanwhile may or may not be covered; it stays owed to the next sync)
        if not self._unsynced or self._w is None:
            return
        self._unsynced = False
        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._fsync_wal)
        except OSError as error:
            self._unsynced = True
            raise self._problem(error, "fsync the WAL") from error

    def operation_ended(self) -> None:
        # what the writer commits from now on is synced, and the WAL checkpointed, once it is quiet
        if self._upkeep is not None:
            self._upkeep.arm()

    def _committed(self, *, durable: bool, events: int) -> None:
        """After a COMMIT under durability "full": a durable one fdatasyncs the WAL (every frame in
        it: this commit's, and the write-behind ones before it); a write-behind one is owed to the
        next durable commit, the upkeep or the close. Every commit tells the upkeep."""
        if self._upkeep is not None:
            self._upkeep.committed(events)
        if self._durability != "full":
            return
        self._unsynced = True
        if durable:
            self._fsync_wal()
            self._unsynced = False

    def staged(self) -> None:
        # an operation still at work (a fan-out's replies, staged as they come): not quiet yet
        if self._upkeep is not None:
            self._upkeep.busy()

    def upkeep_settled(self, timeout_s: float) -> bool:
        """Wait (blocking) until the WAL upkeep has nothing pending or running; False if
        ``timeout_s`` ran out. For benchmarks and tests: nothing else needs to wait for it."""
        upkeep = self._upkeep
        return upkeep.settled(timeout_s) if upkeep is not None else True

    def _fsync_owed(self) -> None:
        """The upkeep's fdatasync (on its thread): the write-behind commits owed to the disk, if
        any. On failure they stay owed, for the next durable commit or the close to report."""
        if not self._unsynced or self._w is None:
            return
        self._unsynced = False
        try:
            self._fsync_wal()
        except OSError:
            self._unsynced = True

    def _fsync_wal(self) -> None:
        """fdatasync the WAL file: every commit so far is on disk when it returns.

        The file is opened once, after the first commit created it, and kept open: SQLite keeps
        the same WAL file (it is reset and rewritten in place, never replaced) while any
        connection — this writer's, at least — is open."""
        fd = self._wal_fd
        if fd is None:
            with self._wal_fd_lock:  # `sync` and a durable commit may both get here first
                fd = self._wal_fd
                if fd is None:
                    fd = self._wal_fd = os.open(
                        self._path.with_name(self._path.name + "-wal"), os.O_RDONLY | os.O_CLOEXEC
                    )
        os.fdatasync(fd)

    async def _rebuild(self, body: Callable[[sqlite3.Connection], _T]) -> _T:
        """``body`` in one durable write transaction on the writer's thread (shielded): a
        projection rebuilt whole, or nothing of it (rolled back on any failure)."""

        def run() -> _T:
            conn = self._w
            if conn is None:
                raise LedgerError(f"ledger {self.where} is not open for writing")
            try:
                conn.execute("BEGIN IMMEDIATE")
                result = body(conn)
                conn.execute("COMMIT")
                # a projection rewritten whole: pages enough to be checkpointed at the next quiet
                self._committed(durable=True, events=CHECKPOINT_AFTER_EVENTS)
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return result

        try:
            with anyio.CancelScope(shield=True):
                done = await anyio.to_thread.run_sync(run, limiter=self._wlimiter)
        except (sqlite3.Error, OSError) as error:
            raise self._problem(error, "rebuilding the projection") from None
        return done

    async def replace_attempts(self, rows: Sequence[AttemptRow]) -> None:
        def swap(conn: sqlite3.Connection) -> None:
            self._cache.clear()
            conn.execute("DELETE FROM attempts")
            conn.executemany(_PUT_ATTEMPT, [stored_values(r) for r in rows])

        await self._rebuild(swap)

    async def rebuild_rollout_refs(self) -> int:
        def swap(conn: sqlite3.Connection) -> int:
            written, after = 0, -(2**63)
            conn.execute("DELETE FROM rollout_refs")
            while True:
                rows = conn.execute(_REF_EVENTS_PAGE, (after, 5000)).fetchall()
                refs = list(refs_of_rows(rows))
                conn.executemany(_PUT_REF, refs)
                written += len(refs)
                if len(rows) < 5000:
                    return written
                after = rows[-1][0]

        return await self._rebuild(swap)

    # -- reads ---------------------------------------------------------------------------------

    async def _query(self, sql: str, params: Sequence[object]) -> list[tuple[object, ...]]:
        def run() -> list[tuple[object, ...]]:
            conn = self._r
            if conn is None:
                raise LedgerError(f"ledger {self.where} is closed")
            try:
                return conn.execute(sql, params).fetchall()
            except sqlite3.Error as error:
                raise self._problem(error, "read") from error

        return await anyio.to_thread.run_sync(run, limiter=self._rlimiter)

    async def event_triggers(self) -> frozenset[str]:
        if self._triggers is not None:
            return self._triggers
        return frozenset(str(row[0]) for row in await self._query(_EVENT_TRIGGERS, ()))

    async def head(self) -> RawEvent | None:
        rows = await self._query(_HEAD_ROW, ())
        return rows[0] if rows else None  # type: ignore[return-value]

    async def tail(self, rows: int) -> list[RawEvent]:
        found = await self._query(_TAIL_ROWS, (rows,))
        return found[::-1]  # type: ignore[return-value]

    async def projection_last_seq(self) -> int | None:
        found = await self._query(_PROJECTION_LAST_SEQ, ())
        value = found[0][0] if found else None
        return int(value) if value is not None else None  # type: ignore[call-overload]

    async def read_page(
        self, after: int, checkpoint_id: str | None, kinds: Sequence[str] | None, limit: int
    ) -> list[RawEvent]:
        where = ["seq > ?"]
        params: list[object] = [after]
        if checkpoint_id is not None:
            where.append("checkpoint_id = ?")
            params.append(checkpoint_id)
        if kinds is not None:
            where.append(f"kind IN ({', '.join('?' * len(kinds))})")
            params.extend(kinds)
            if kinds and all(indexed_kind(k) for k in kinds):
                where.append(MARKER_WHERE_SQLITE)  # lets the planner use the marker index
        params.append(limit)
        sql = f"SELECT {_EV_COLS} FROM events WHERE {' AND '.join(where)} ORDER BY seq LIMIT ?"
        return await self._query(sql, params)  # type: ignore[return-value]

    async def read_last(self, kind: str, before: int) -> RawEvent | None:
        rows = await self._query(read_last_sql(kind), (kind, before))
        return rows[0] if rows else None  # type: ignore[return-value]

    async def attempts(self, query: AttemptQuery) -> list[AttemptRow]:
        where, params = ["1 = 1"], list[object]()
        if query.since is not None:
            where.append("started_at >= ?")
            params.append(query.since)
        if query.outcome == OPEN:
            where.append("outcome IS NULL")
        elif isinstance(query.outcome, tuple):
            where.append(f"outcome IN ({', '.join('?' for _ in query.outcome)})")
            params.extend(query.outcome)
        elif query.outcome is not None:
            where.append("outcome = ?")
            params.append(query.outcome)
        if query.before is not None:
            where.append("(started_at, checkpoint_id) < (?, ?)")
            params.extend(query.before)
        order = "started_at, checkpoint_id"
        if query.limit:  # the newest first, from the end of ix_attempts_started; then reversed
            order = "started_at DESC, checkpoint_id DESC LIMIT ?"
            params.append(query.limit)
        sql = f"SELECT {_AT_COLS} FROM attempts WHERE {' AND '.join(where)} ORDER BY {order}"
        rows = [from_columns(row) for row in await self._query(sql, params)]
        return rows[::-1] if query.limit else rows

    async def rollout_refs_page(self, after: tuple[str, int] | None, limit: int) -> list[tuple[str, int]]:
        params: list[object]
        if after is None:
            sql, params = "SELECT rollout_id, seq FROM rollout_refs ORDER BY rollout_id, seq LIMIT ?", [limit]
        else:
            sql = (
                "SELECT rollout_id, seq FROM rollout_refs WHERE (rollout_id, seq) > (?, ?)"
                " ORDER BY rollout_id, seq LIMIT ?"
            )
            params = [after[0], after[1], limit]
        return [(str(r), int(s)) for r, s in await self._query(sql, params)]  # type: ignore[call-overload]

    async def rollout_refs_between(self, lo: int, hi: int) -> list[tuple[str, int]]:
        rows = await self._query(
            "SELECT rollout_id, seq FROM rollout_refs WHERE seq BETWEEN ? AND ?", (lo, hi)
        )
        return [(str(r), int(s)) for r, s in rows]  # type: ignore[call-overload]

    async def attempt(self, checkpoint_id: str) -> AttemptRow | None:
        rows = await self._query(_GET_ATTEMPT, (checkpoint_id,))
        return from_columns(rows[0]) if rows else None

    async def unfinished_attempts(self) -> list[AttemptRow]:
        return [from_columns(row) for row in await self._query(_UNFINISHED, ())]

    async def calls_after(self, marks: Sequence[tuple[str, int]]) -> list[int]:
        if not marks:
            return []

        def run() -> list[int]:
            conn = self._r
            if conn is None:
                raise LedgerError(f"ledger {self.where} is closed")
            out: list[int] = []
            try:
                for at in range(0, len(marks), _MARKS_PER_QUERY):
                    part = marks[at : at + _MARKS_PER_QUERY]
                    params = [value for mark in part for value in mark]
                    out.extend(int(n) for (n,) in conn.execute(_calls_after_sql(len(part)), params))
            except sqlite3.Error as error:
                raise self._problem(error, "read") from error
            return out

        return await anyio.to_thread.run_sync(run, limiter=self._rlimiter)
