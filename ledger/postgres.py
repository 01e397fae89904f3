"""The PostgreSQL backend (asyncpg through SQLAlchemy's async engine).

- Writership: a session-level ``pg_try_advisory_lock(WRITER_LOCK_KEY)`` on the writer's held
  connection (released by the server when that session ends, e.g. the process dies). Commit
  order is seq order even if the claim were bypassed, with no lock per append: revision 0003's
  insert-at-head trigger admits only the row after the committed head, and a second session
  inserting that same seq meanwhile waits on the seq key for the first one's outcome, then is
  refused (a duplicate key) — so no row can commit before the rows it follows.
- ``durability="process"`` sets ``synchronous_commit = off`` on the writer session: an append
  survives the writer's crash but not a crash of the database server. A write-behind append
  (``durable=False``) under "full" sets it for its own transaction only (``SET LOCAL``); the next
  synchronous commit flushes the WAL past it, and closing the ledger ends with one such commit.
- An append runs on the writer session's own asyncpg connection (the driver connection under
  SQLAlchemy's), not through SQLAlchemy, as ONE statement (``append_statement``) — its own
  transaction, one round trip, as a plain autocommit insert: the events insert (for a
  write-behind one, with ``synchronous_commit`` off for that transaction) and the ``attempts``
  upsert, committed together or not at all. ``apply_append``'s head check is revision 0003's
  insert-at-head trigger (each row must be the next seq and link to the stored head's hash; its
  query sees the latest commit) and the seq primary key: a refusal raises, writes nothing, and
  fences this writer with the head as it is now (a newer epoch, or a row it did not write). The
  projection rows it folds from come from the writer's cache, or are read first in one query
  (only this writer writes them).
- Losing the writer session (the server ended it — e.g. a standby's ``pg_terminate_backend`` —
  or the connection broke) loses the writer lock with it, so an append that fails that way
  raises ``FencedError``: this writer must stop.
- The coordinator lease (table ``quiesce_lease``): one row per lease name with the holder, its
  epoch, its writer session pid and ``expires_at`` in Unix seconds of the database server's
  clock (``clock_timestamp()``), so every comparison uses one clock. Taking it is one
  ``INSERT .. ON CONFLICT DO UPDATE .. WHERE`` statement (expired, or already ours), so two
  standbys cannot both take it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import anyio
import asyncpg
from sqlalchemy import Connection, Select, bindparam, delete, func, insert, select, text, tuple_
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from quiesce.ledger.backend import (
    OPEN,
    WRITER_LOCK_KEY,
    AttemptQuery,
    Backend,
    Batch,
    LeaseState,
    ProjectionCache,
    RawEvent,
    apply_append,
    refusal,
)
from quiesce.ledger.errors import FencedError, LedgerError
from quiesce.ledger.layout import MARKER_WHERE_POSTGRESQL, VERSION_TABLE, indexed_kind
from quiesce.ledger.projections import COLUMNS, AttemptRow, from_columns, stored_values, to_columns, touched
from quiesce.ledger.rollout_refs import REF_KINDS, refs_of_rows
from quiesce.ledger.schema import EVENT_COLUMNS, attempts, events, rollout_refs

_EVENT_COLS = [events.c[name] for name in EVENT_COLUMNS]
_ATTEMPT_COLS = list(attempts.c)
#: How long a writer waits for a previous writer's session to end (e.g. one that was just killed).
CLAIM_WAIT_S = 2.0

# The append's statements on the asyncpg connection (see the module docstring).
_EV_TYPES = ("bigint", "varchar", "varchar", "varchar", "varchar", "varchar", "bigint", "text", "varchar",
             "varchar")  # fmt: skip
_AT_TYPES = ("varchar", "varchar", "varchar", "varchar", "varchar", "varchar", "float8", "text", "bigint",
             "bigint", "bigint", "bigint", "bigint")  # fmt: skip


@functools.cache
def append_statement(behind: bool, one_row: bool, puts: int, refs: bool = False) -> str:
    """One append as one statement (see the module docstring): an ``INSERT`` of the events whose
    ``attempts`` upsert (``puts`` rows) is a data-modifying ``WITH``; ``$1``.. are the events'
    columns, then the ``attempts`` rows'.
    ``one_row`` (one event, at most one projection row: a recorded call's usual append) passes
    the columns as plain parameters; otherwise each column is an array of the rows' values (one
    array per column, ``unnest``ed), as is every projection column when ``puts`` > 1.
    Its status tag counts the events that went in: all of them — a row that is not the next link
    of the stored chain is refused by revision 0003's insert-at-head trigger (or the seq key),
    which raises, and the statement writes nothing, projection rows included. ``behind``: the
    transaction commits with ``synchronous_commit`` off (a write-behind append under "full"),
    set by the insert's own ``FROM``, so before any row goes in. ``refs``: the ``rollout_refs`` rows
    of the batch's lineage events go in by one more ``WITH`` insert, from the last two parameters
    (arrays of rollout ids and seqs), in the same statement: together with the events or not at all."""
    n = len(_EV_TYPES)

    def source(types: Sequence[str], first: int, scalar: bool) -> str:
        """The rows' values: one row of parameters, or a row per array element (``AS v``)."""
        if scalar:
            return "SELECT " + ", ".join(f"${i + first}::{t}" for i, t in enumerate(types))
        arrays = ", ".join(f"${i + first}::{t}[]" for i, t in enumerate(types))
        return f"SELECT v.* FROM unnest({arrays}) AS v"

    statement = ""
    if puts:
        statement = (
            f"WITH up AS (INSERT INTO attempts ({', '.join(COLUMNS)}) {source(_AT_TYPES, 1 + n, puts == 1)} "
            "ON CONFLICT (checkpoint_id) DO UPDATE SET "
            + ", ".join(f"{c} = excluded.{c}" for c in COLUMNS if c != "checkpoint_id")
            + ") "
        )
    if refs:
        first = 1 + n + (len(_AT_TYPES) if puts else 0)
        inserted = (
            f"rf AS (INSERT INTO rollout_refs (rollout_id, seq) SELECT * FROM unnest(${first}::varchar[],"
            f" ${first + 1}::bigint[])) "
        )
        statement = f"{statement[:-1]}, {inserted}" if statement else f"WITH {inserted}"
    rows = source(_EV_TYPES, 1, one_row)
    if behind:  # a subquery with a volatile call is evaluated (never pulled up) before any row is made
        setting = "(SELECT set_config('synchronous_commit', 'off', true)) AS cfg"
        rows += f" FROM {setting}" if one_row else f", {setting}"
    return statement + f"INSERT INTO events ({', '.join(EVENT_COLUMNS)}) {rows}"


_A_HEAD = "SELECT seq, epoch FROM events ORDER BY seq DESC LIMIT 1"
#: The rows, each with the ``call.sent`` events of its id after its ``last_seq`` (``Tx.get_attempt``).
_A_GET = (
    f"SELECT {', '.join(f'a.{c}' for c in COLUMNS)}, (SELECT count(*) FROM events e"
    " WHERE e.checkpoint_id = a.checkpoint_id AND e.seq > a.last_seq AND e.kind = 'call.sent')"
    " FROM attempts a WHERE a.checkpoint_id = ANY($1::varchar[])"
)
#: ``Backend.calls_after``: per (id, seq) pair, in order.
_CALLS_AFTER = text(
    "SELECT m.i, (SELECT count(*) FROM events e WHERE e.checkpoint_id = m.cid AND e.seq > m.after"
    " AND e.kind = 'call.sent') FROM unnest(CAST(:cids AS VARCHAR[]), CAST(:afters AS BIGINT[]))"
    " WITH ORDINALITY AS m(cid, after, i) ORDER BY m.i"
)


class _Prefetched:
    """``apply_append``'s transaction view for the asyncpg path: the head check is deferred to the
    conditional insert (``accepted`` records whether it was asked), projection rows come from a
    prefetch, and the rows to store are collected for one upsert."""

    __slots__ = ("found", "puts", "refs")

    def __init__(self, found: dict[str, tuple[AttemptRow, int]]) -> None:
        self.found = found
        self.puts: list[AttemptRow] = []
        self.refs: list[tuple[str, int]] = []

    def head(self) -> tuple[int, int] | None:  # never asked: insert_after always accepts here
        raise AssertionError("head() is read by the conditional insert")

    def insert_after(self, last: int, rows: list[RawEvent]) -> bool:
        return True

    def get_attempt(self, checkpoint_id: str) -> tuple[AttemptRow, int] | None:
        return self.found.get(checkpoint_id)

    def put_attempt(self, row: AttemptRow, before: AttemptRow | None) -> None:
        self.puts.append(row)

    def put_refs(self, refs: list[tuple[str, int]]) -> None:
        self.refs.extend(refs)


_NOW = "extract(epoch from clock_timestamp())::float8"
_LEASE_EXISTS = text("SELECT to_regclass('quiesce_lease') IS NOT NULL")
_LEASE_READ = text(
    f"SELECT holder, epoch, expires_at, {_NOW}, writer_pid FROM quiesce_lease WHERE name = :name"
)
_LEASE_TAKE = text(
    "INSERT INTO quiesce_lease (name, holder, epoch, expires_at, writer_pid) "
    f"VALUES (:name, :holder, 0, {_NOW} + :ttl, :pid) "
    "ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at, "
    "writer_pid = excluded.writer_pid "
    f"WHERE :force OR quiesce_lease.expires_at <= {_NOW} OR quiesce_lease.holder = excluded.holder"
)
_LEASE_RENEW = text(
    f"UPDATE quiesce_lease SET expires_at = {_NOW} + :ttl, epoch = :epoch "
    "WHERE name = :name AND holder = :holder"
)
_LEASE_RELEASE = text(f"UPDATE quiesce_lease SET expires_at = {_NOW} WHERE name = :name AND holder = :holder")
_WRITER_PIDS = text(
    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
    "AND ((classid::bigint << 32) | objid::bigint) = :k"
)


def read_last_statement(kind: str, before: int) -> Select[Any]:
    """The query of ``read_last``: one lookup in the marker index for an indexed kind (the
    predicate named verbatim: the planner proves nothing from a bound ``kind``); a backward scan
    of the seq order for a ``call.*`` or ``phase.*`` kind, which are nine events in ten."""
    statement = select(*_EVENT_COLS).where(events.c.kind == kind, events.c.seq < before)
    if indexed_kind(kind):
        statement = statement.where(text(MARKER_WHERE_POSTGRESQL))
    return statement.order_by(events.c.seq.desc()).limit(1)


#: A transaction that writes WAL (a new version of the one row of quiesce's own version table, its
#: value unchanged) and commits synchronously whatever the server's default: committing it flushes
#: the WAL past every earlier commit. (A transaction that only takes an xid writes no WAL record of
#: its own before its commit record, and PostgreSQL then commits it asynchronously.)
_FLUSH_WAL: Final = (
    "WITH s AS (SELECT set_config('synchronous_commit', 'on', true))"
    f" UPDATE {VERSION_TABLE} SET version_num = version_num FROM s"
)


#: What a statement on a session of the writer's may raise when the session or the server fails.
#: ``InternalClientError``: asyncpg's own state machine refusing a statement on a session the server
#: ended while it sat idle (seen after ``pg_terminate_backend``: "cannot switch to state 15; another
#: operation (2) is in progress"), a lost session like any other.
_CONNECTION_ERRORS: Final = (
    DBAPIError,
    OSError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
)


async def _connect_unbroken(*args: Any, **kwargs: Any) -> Any:
    """``asyncpg.connect(*args, **kwargs)``, which a cancellation of the caller never interrupts
    midway: the caller is cancelled at once, the connect goes on alone, and the connection it
    makes (or its error) is dropped when it ends (within asyncpg's connect timeout).

    asyncpg cancelled inside its SSL probe (``sslmode=prefer``, the default) leaves a future
    failed with "unexpected connection_lost() call" that nobody retrieves: asyncio logs it as an
    error, and under anyio's test runner it fails the test. A deadline that cancels a ledger read
    while the pool opens a connection would do just that."""
    task = asyncio.ensure_future(asyncpg.connect(*args, **kwargs))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_drop_connect)
        raise


def _drop_connect(task: asyncio.Future[Any]) -> None:
    """After a connect its caller gave up on: its connection closed, its error retrieved (so
    asyncio logs nothing)."""
    if task.cancelled():
        return
    if task.exception() is None:
        task.result().terminate()


class PostgresBackend(Backend):
    dialect = "postgresql"

    def __init__(self, url: URL, *, where: str, durability: str, readonly: bool) -> None:
        self.where = where
        self._durability = durability
        self._readonly = readonly
        # ``async_creator_fn``: the connect call SQLAlchemy's asyncpg dialect makes with the URL's
        # arguments (what its documented ``async_creator`` builds on), here the unbroken one
        self._engine: AsyncEngine = create_async_engine(
            url, pool_size=4, max_overflow=8, connect_args={"async_creator_fn": _connect_unbroken}
        )
        self._writer: AsyncConnection | None = None
        self._cache = ProjectionCache()
        self._unsynced = False  # the last append was write-behind (not yet flushed for sure)
        self._driver: Any = None  # the writer session's asyncpg connection (appends)
        #: a session of its own for ``sync`` (held once used), so appends go on while it waits
        self._syncer: AsyncConnection | None = None
        self._sync_driver: Any = None
        self._sync_lock = anyio.Lock()
        self._shield_scope: type[anyio.CancelScope] = anyio.CancelScope
        #: ``pg_backend_pid()`` of the writer session once writership is claimed.
        self.writer_pid: int | None = None

    def _error(self, doing: str, error: DBAPIError) -> LedgerError:
        return LedgerError(f"ledger {self.where}: {doing} failed: {error.orig}")

    async def claim_writer(self) -> None:
        try:
            conn = await self._engine.connect()
        except (DBAPIError, OSError) as error:
            await self._engine.dispose()
            raise LedgerError(
                f"cannot connect to ledger {self.where}: {getattr(error, 'orig', error)}"
            ) from None
        deadline = time.monotonic() + CLAIM_WAIT_S
        while True:
            got = await conn.scalar(text("SELECT pg_try_advisory_lock(:k)"), {"k": WRITER_LOCK_KEY})
            await conn.commit()
            if got:
                break
            if time.monotonic() >= deadline:
                holder = await conn.scalar(
                    text(
                        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                        "AND ((classid::bigint << 32) | objid::bigint) = :k LIMIT 1"
                    ),
                    {"k": WRITER_LOCK_KEY},
                )
                await conn.close()
                raise FencedError(
                    f"ledger {self.where} already has a writer (database session pid {holder} holds the "
                    "writer lock); only one coordinator may write a ledger: stop the other one, or open "
                    "this ledger readonly"
                )
            await anyio.sleep(0.05)
        if self._durability == "process":
            await conn.execute(text("SET synchronous_commit = off"))
            await conn.commit()
        pid = await conn.scalar(text("SELECT pg_backend_pid()"))
        await conn.commit()
        self.writer_pid = int(pid) if pid is not None else None
        self._writer = conn

    async def run_schema(self, fn: Callable[[Connection], object]) -> object:
        try:
            async with self._engine.begin() as conn:
                return await conn.run_sync(fn)
        except DBAPIError as error:
            raise self._error("schema check", error) from None
        except OSError as error:
            raise LedgerError(f"cannot connect to ledger {self.where}: {error}") from None

    async def start(self) -> None:
        # ``anyio.CancelScope()`` looks up the running async backend on every call; this
        # backend's connections belong to one event loop, so its shield class is fixed: the class
        # ``anyio.CancelScope()`` gives here, which takes the same arguments.
        self._shield_scope = type(anyio.CancelScope())

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._drop_syncer()
            writer, self._writer = self._writer, None
            if writer is not None:
                try:
                    await writer.rollback()
                    if self._unsynced:
                        # a commit that wrote WAL, made synchronously: the WAL is flushed past
                        # every earlier write-behind commit before this returns
                        await writer.execute(text(_FLUSH_WAL))
                        await writer.commit()
                        self._unsynced = False
                    await writer.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": WRITER_LOCK_KEY})
                    await writer.commit()
                except (DBAPIError, OSError):
                    pass  # the session ends below; the server releases the lock with it
                await writer.close()
            await self._engine.dispose()

    async def _asyncpg(self) -> Any:
        """The writer session's asyncpg connection (the same session: its locks are the writer's)."""
        if self._driver is None:
            assert self._writer is not None
            raw = await self._writer.get_raw_connection()
            self._driver = raw.driver_connection
        return self._driver

    async def _append_fast(self, batch: Batch) -> None:
        """``apply_append`` as one statement in its own transaction (see the module docstring)."""
        conn = self._driver if self._driver is not None else await self._asyncpg()
        rows = batch.rows
        cached = self._cache.rows
        behind = not batch.durable and self._durability == "full"
        try:
            found: dict[str, tuple[AttemptRow, int]] = {}
            missing = [cid for e in batch.events for cid in touched(e) if cid not in cached]
            if missing:  # the writer's cache lacks them: read before the statement (only this writer writes)
                fetched = await conn.fetch(_A_GET, sorted(set(missing)))
                found = {r[0]: (from_columns(tuple(r)[:-1]), int(r[-1])) for r in fetched}
            tx = _Prefetched(found)
            written = apply_append(tx, batch, self._cache)
            puts, refs = tx.puts, tx.refs
            params: Sequence[Any]
            if len(rows) == 1 and len(puts) <= 1 and not refs:  # a recorded call's append: plain parameters
                statement = append_statement(behind, True, len(puts))
                params = (*rows[0], *stored_values(puts[0])) if puts else rows[0]
            else:
                statement = append_statement(behind, False, min(len(puts), 2), bool(refs))
                arrays: list[Any] = [list(column) for column in zip(*rows, strict=True)]
                if len(puts) == 1:
                    arrays += stored_values(puts[0])
                elif puts:
                    arrays += [list(c) for c in zip(*map(stored_values, puts), strict=True)]
                if refs:
                    arrays += [[r for r, _ in refs], [seq for _, seq in refs]]
                params = arrays
            try:
                status = await conn.execute(statement, *params)  # the events insert's tag, "INSERT 0 <rows>"
                inserted = int(status.rsplit(" ", 1)[1])
            except asyncpg.IntegrityConstraintViolationError:  # the 0003 trigger or the seq key refused it
                inserted = None
            if inserted != len(rows):  # nothing was written: the head is not where this writer left it
                raise await self._refusal(conn, batch)
        except BaseException:
            self._cache.clear()
            raise
        self._cache.committed(written)
        self._unsynced = behind

    async def _refusal(self, conn: Any, batch: Batch) -> FencedError:
        """Why the stored chain refused ``batch`` (``refusal``), its head read now."""
        head = await conn.fetchrow(_A_HEAD)
        return refusal((int(head[0]), int(head[1])) if head is not None else None, batch)

    async def append(self, batch: Batch) -> None:
        if self._writer is None:
            raise LedgerError(f"ledger {self.where} is not open for writing")
        try:
            with self._shield_scope(shield=True):
                await self._append_fast(batch)
        except (IntegrityError, asyncpg.IntegrityConstraintViolationError):  # the seq key, the 0003 trigger
            raise FencedError(
                f"ledger {self.where}: seq {batch.rows[0][0]} was taken by another writer; this "
                "writer is fenced and must stop making calls"
            ) from None
        except FencedError:
            raise
        except _CONNECTION_ERRORS as error:
            self._driver = None
            if await self._writer_lost():
                cause = getattr(error, "orig", error)
                raise FencedError(
                    f"ledger {self.where}: the writer's database session is gone ({cause}), and the"
                    " writer lock with it — a standby may have taken over. This writer is fenced and"
                    " must stop making calls; start a new coordinator (it takes a new epoch and recovers)."
                ) from None
            if isinstance(error, DBAPIError):
                raise self._error("append", error) from None
            raise LedgerError(f"ledger {self.where}: append failed: {error}") from None

    async def _writer_lost(self) -> bool:
        """Whether the writer session ended (then the server released its writer lock too)."""
        writer = self._writer
        if writer is None or writer.invalidated or writer.closed:
            return True
        try:
            with anyio.CancelScope(shield=True), anyio.fail_after(CLAIM_WAIT_S):
                await writer.rollback()
                await writer.scalar(text("SELECT 1"))
                await writer.rollback()
        except (DBAPIError, OSError, TimeoutError):
            return True
        return False

    async def replace_attempts(self, rows: Sequence[AttemptRow]) -> None:
        if self._writer is None:
            raise LedgerError(f"ledger {self.where} is not open for writing")

        self._cache.clear()

        def swap(conn: Connection) -> None:
            with conn.begin():
                conn.execute(delete(attempts))
                if rows:
                    conn.execute(insert(attempts), [to_columns(r) for r in rows])

        with anyio.CancelScope(shield=True):
            await self._writer.run_sync(swap)

    # -- the coordinator lease -----------------------------------------------------------------

    supports_lease = True

    async def _lease_statement(self, statement: Any, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        try:
            async with self._engine.begin() as conn:
                if not await conn.scalar(_LEASE_EXISTS):
                    return []
                result = await conn.execute(statement, params)
                return [tuple(row) for row in result.all()] if result.returns_rows else [(result.rowcount,)]
        except DBAPIError as error:
            raise self._error("lease", error) from None
        except OSError as error:
            raise LedgerError(f"cannot connect to ledger {self.where}: {error}") from None

    async def lease_read(self, name: str) -> LeaseState | None:
        rows = await self._lease_statement(_LEASE_READ, {"name": name})
        if not rows:
            return None
        holder, epoch, expires_at, now, pid = rows[0]
        return LeaseState(str(holder), int(epoch), float(expires_at), float(now), pid)

    async def lease_take(self, name: str, holder: str, ttl_s: float, *, force: bool) -> LeaseState | None:
        done = await self._lease_statement(
            _LEASE_TAKE,
            {"name": name, "holder": holder, "ttl": float(ttl_s), "pid": self.writer_pid, "force": force},
        )
        return await self.lease_read(name) if done else None

    async def lease_renew(self, name: str, holder: str, ttl_s: float, epoch: int) -> bool:
        rows = await self._lease_statement(
            _LEASE_RENEW, {"name": name, "holder": holder, "ttl": float(ttl_s), "epoch": epoch}
        )
        return bool(rows and rows[0][0])

    async def lease_release(self, name: str, holder: str) -> None:
        await self._lease_statement(_LEASE_RELEASE, {"name": name, "holder": holder})

    async def end_writer_session(self, pid: int) -> bool:
        try:
            async with self._engine.connect() as conn:
                rows = (await conn.execute(_WRITER_PIDS, {"k": WRITER_LOCK_KEY})).all()
                holders = {int(p) for (p,) in rows}
                if pid not in holders:
                    return False
                ended = await conn.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
                await conn.commit()
                return bool(ended)
        except DBAPIError as error:
            raise self._error("ending the previous writer's session", error) from None

    async def sync(self) -> None:
        # On a session of its own, not the writer's: appends go on meanwhile. One statement in its
        # own transaction (one round trip) that writes WAL and commits synchronously (set by the
        # statement: whatever the server's default); WAL is flushed in order, so every earlier
        # write-behind commit is on disk once it has committed.
        if not self._unsynced:
            return
        self._unsynced = False
        try:
            with anyio.CancelScope(shield=True):
                async with self._sync_lock:
                    if self._sync_driver is None:
                        self._syncer = await self._engine.connect()
                        self._sync_driver = (await self._syncer.get_raw_connection()).driver_connection
                    await self._sync_driver.execute(_FLUSH_WAL)
        except _CONNECTION_ERRORS as error:
            self._unsynced = True
            await self._drop_syncer(failed=True)
            raise LedgerError(
                f"ledger {self.where}: making the last commits durable failed:"
                f" {getattr(error, 'orig', error)}"
            ) from None

    async def _drop_syncer(self, *, failed: bool = False) -> None:
        """Let go of ``sync``'s session, at close or after it ``failed`` (then it is discarded, not
        pooled again); the next sync opens another."""
        syncer, self._syncer, self._sync_driver = self._syncer, None, None
        if syncer is not None:
            with anyio.CancelScope(shield=True), contextlib.suppress(*_CONNECTION_ERRORS):
                await (syncer.invalidate() if failed else syncer.close())

    async def _rows(self, statement: Any) -> list[tuple[Any, ...]]:
        try:
            async with self._engine.connect() as conn:
                result = await conn.execute(statement)
                return [tuple(row) for row in result.all()]
        except DBAPIError as error:
            raise self._error("read", error) from None

    async def event_triggers(self) -> frozenset[str]:
        found = await self._rows(
            text("SELECT tgname FROM pg_trigger WHERE tgrelid = to_regclass('events') AND NOT tgisinternal")
        )
        return frozenset(str(row[0]) for row in found)

    async def head(self) -> RawEvent | None:
        rows = await self._rows(select(*_EVENT_COLS).order_by(events.c.seq.desc()).limit(1))
        return rows[0] if rows else None

    async def tail(self, rows: int) -> list[RawEvent]:
        found = await self._rows(select(*_EVENT_COLS).order_by(events.c.seq.desc()).limit(rows))
        return found[::-1]

    async def projection_last_seq(self) -> int | None:
        rows = await self._rows(select(func.max(attempts.c.last_seq)))
        return int(rows[0][0]) if rows and rows[0][0] is not None else None

    async def read_page(
        self, after: int, checkpoint_id: str | None, kinds: Sequence[str] | None, limit: int
    ) -> list[RawEvent]:
        statement = select(*_EVENT_COLS).where(events.c.seq > after)
        if checkpoint_id is not None:
            statement = statement.where(events.c.checkpoint_id == checkpoint_id)
        if kinds is not None:
            statement = statement.where(events.c.kind.in_(list(kinds)))
            if kinds and all(indexed_kind(k) for k in kinds):
                statement = statement.where(text(MARKER_WHERE_POSTGRESQL))  # the marker index may serve it
        return await self._rows(statement.order_by(events.c.seq).limit(limit))

    async def read_last(self, kind: str, before: int) -> RawEvent | None:
        rows = await self._rows(read_last_statement(kind, before))
        return rows[0] if rows else None

    async def attempts(self, query: AttemptQuery) -> list[AttemptRow]:
        statement = select(*_ATTEMPT_COLS)
        if query.since is not None:
            statement = statement.where(attempts.c.started_at >= query.since)
        if query.outcome == OPEN:
            statement = statement.where(attempts.c.outcome.is_(None))
        elif isinstance(query.outcome, tuple):
            statement = statement.where(attempts.c.outcome.in_(query.outcome))
        elif query.outcome is not None:
            statement = statement.where(attempts.c.outcome == query.outcome)
        key = tuple_(attempts.c.started_at, attempts.c.checkpoint_id)
        if query.before is not None:
            statement = statement.where(key < tuple_(*query.before))
        if query.limit:  # the newest first, from the end of ix_attempts_started; then reversed
            newest = statement.order_by(attempts.c.started_at.desc(), attempts.c.checkpoint_id.desc())
            rows = await self._rows(newest.limit(query.limit))
            return [from_columns(row) for row in reversed(rows)]
        rows = await self._rows(statement.order_by(attempts.c.started_at, attempts.c.checkpoint_id))
        return [from_columns(row) for row in rows]

    # -- the rollout_refs projection and one rollout's lineage ---------------------------------------

    async def rebuild_rollout_refs(self) -> int:
        if self._writer is None:
            raise LedgerError(f"ledger {self.where} is not open for writing")
        page = (
            select(events.c.seq, events.c.kind, events.c.data)
            .where(events.c.kind.in_(sorted(REF_KINDS)), events.c.seq > bindparam("after"))
            .where(text(MARKER_WHERE_POSTGRESQL))
            .order_by(events.c.seq)
            .limit(5000)
        )

        def swap(conn: Connection) -> int:
            written, after = 0, -(2**63)
            with conn.begin():
                conn.execute(delete(rollout_refs))
                while True:
                    rows = [tuple(row) for row in conn.execute(page, {"after": after})]
                    refs = [{"rollout_id": r, "seq": seq} for r, seq in refs_of_rows(rows)]
                    if refs:
                        conn.execute(insert(rollout_refs), refs)
                    written += len(refs)
                    if len(rows) < 5000:
                        return written
                    after = int(rows[-1][0])

        with anyio.CancelScope(shield=True):
            written = await self._writer.run_sync(swap)
        return int(written)

    async def rollout_ref_seqs(self, rollout_ids: Sequence[str]) -> list[int]:
        if not rollout_ids:
            return []
        statement = (
            select(rollout_refs.c.seq)
            .where(rollout_refs.c.rollout_id.in_(list(rollout_ids)))
            .distinct()
            .order_by(rollout_refs.c.seq)
        )
        return [int(row[0]) for row in await self._rows(statement)]

    async def events_at(self, seqs: Sequence[int]) -> list[RawEvent]:
        if not seqs:
            return []
        return await self._rows(
            select(*_EVENT_COLS).where(events.c.seq.in_(list(seqs))).order_by(events.c.seq)
        )

    async def checkpoint_rows(self, checkpoint_ids: Sequence[str], kinds: Sequence[str]) -> list[RawEvent]:
        if not checkpoint_ids or not kinds:
            return []
        statement = (
            select(*_EVENT_COLS)
            .where(events.c.checkpoint_id.in_(list(checkpoint_ids)), events.c.kind.in_(list(kinds)))
            .order_by(events.c.seq)
        )
        return await self._rows(statement)

    async def first_in_ranges(
        self, kinds: Sequence[str], ranges: Sequence[tuple[int, int | None]]
    ) -> list[int | None]:
        if not kinds or not ranges:
            return [None] * len(ranges)
        firsts = ", ".join(
            f"(SELECT seq FROM events WHERE kind = :k{i} AND seq > g.lo AND seq < g.hi"
            f" AND {MARKER_WHERE_POSTGRESQL} ORDER BY seq LIMIT 1)"
            for i in range(len(kinds))
        )
        statement = text(
            f"SELECT g.i, {firsts} FROM unnest(CAST(:lo AS BIGINT[]), CAST(:hi AS BIGINT[]))"
            " WITH ORDINALITY AS g(lo, hi, i) ORDER BY g.i"
        ).bindparams(
            lo=[lo for lo, _ in ranges],
            hi=[2**63 - 1 if hi is None else hi for _, hi in ranges],
            **{f"k{i}": kind for i, kind in enumerate(kinds)},
        )
        rows = await self._rows(statement)
        return [min((int(x) for x in row[1:] if x is not None), default=None) for row in rows]

    async def last_before_each(self, kind: str, seqs: Sequence[int]) -> list[int | None]:
        if not seqs:
            return []
        statement = text(
            "SELECT g.i, (SELECT seq FROM events WHERE kind = :kind AND seq < g.x"
            f" AND {MARKER_WHERE_POSTGRESQL} ORDER BY seq DESC LIMIT 1)"
            " FROM unnest(CAST(:xs AS BIGINT[])) WITH ORDINALITY AS g(x, i) ORDER BY g.i"
        ).bindparams(kind=kind, xs=list(seqs))
        return [None if row[1] is None else int(row[1]) for row in await self._rows(statement)]

    async def rollout_refs_page(self, after: tuple[str, int] | None, limit: int) -> list[tuple[str, int]]:
        statement = select(rollout_refs.c.rollout_id, rollout_refs.c.seq)
        if after is not None:
            statement = statement.where(
                tuple_(rollout_refs.c.rollout_id, rollout_refs.c.seq) > tuple_(*after)
            )
        statement = statement.order_by(rollout_refs.c.rollout_id, rollout_refs.c.seq).limit(limit)
        return [(str(r), int(seq)) for r, seq in await self._rows(statement)]

    async def rollout_refs_between(self, lo: int, hi: int) -> list[tuple[str, int]]:
        statement = select(rollout_refs.c.rollout_id, rollout_refs.c.seq).where(
            rollout_refs.c.seq.between(lo, hi)
        )
        return [(str(r), int(seq)) for r, seq in await self._rows(statement)]

    async def attempt(self, checkpoint_id: str) -> AttemptRow | None:
        rows = await self._rows(select(*_ATTEMPT_COLS).where(attempts.c.checkpoint_id == checkpoint_id))
        return from_columns(rows[0]) if rows else None

    async def calls_after(self, marks: Sequence[tuple[str, int]]) -> list[int]:
        if not marks:
            return []
        statement = _CALLS_AFTER.bindparams(cids=[c for c, _ in marks], afters=[a for _, a in marks])
        return [int(row[1]) for row in await self._rows(statement)]

    async def unfinished_attempts(self) -> list[AttemptRow]:
        statement = select(*_ATTEMPT_COLS).where(attempts.c.outcome.is_(None)).order_by(attempts.c.last_seq)
        return [from_columns(row) for row in await self._rows(statement)]
