"""The PostgreSQL backend (asyncpg through SQLAlchemy's async engine).

- Writership: a session-level ``pg_try_advisory_lock(WRITER_LOCK_KEY)`` on the writer's held
  connection (released by the server when that session ends, e.g. the process dies), plus
  ``pg_advisory_xact_lock(APPEND_LOCK_KEY)`` inside each append transaction, so commit order is
  seq order even if the claim were bypassed.
- ``durability="process"`` sets ``synchronous_commit = off`` on the writer session: an append
  survives the writer's crash but not a crash of the database server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from sqlalchemy import Connection, delete, insert, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from ledger.backend import (
    APPEND_LOCK_KEY,
    WRITER_LOCK_KEY,
    Backend,
    Batch,
    ProjectionCache,
    RawEvent,
    apply_append,
)
from ledger.errors import FencedError, LedgerError
from ledger.projections import AttemptRow, from_columns, to_columns
from ledger.schema import EVENT_COLUMNS, attempts, events

_EVENT_COLS = [events.c[name] for name in EVENT_COLUMNS]
_ATTEMPT_COLS = list(attempts.c)
_UPSERT = pg_insert(attempts)
_UPSERT = _UPSERT.on_conflict_do_update(
    index_elements=[attempts.c.checkpoint_id],
    set_={c.name: _UPSERT.excluded[c.name] for c in attempts.c if c.name != "checkpoint_id"},
)
#: How long a writer waits for a previous writer's session to end (e.g. one that was just killed).
CLAIM_WAIT_S = 2.0


class _PgTx:
    __slots__ = ("_c",)

    def __init__(self, connection: Connection) -> None:
        self._c = connection

    def head(self) -> tuple[int, int] | None:
        row = self._c.execute(
            select(events.c.seq, events.c.epoch).order_by(events.c.seq.desc()).limit(1)
        ).first()
        return (int(row[0]), int(row[1])) if row is not None else None

    def insert(self, rows: list[RawEvent]) -> None:
        self._c.execute(insert(events), [dict(zip(EVENT_COLUMNS, row, strict=True)) for row in rows])

    def get_attempt(self, checkpoint_id: str) -> AttemptRow | None:
        row = self._c.execute(select(*_ATTEMPT_COLS).where(attempts.c.checkpoint_id == checkpoint_id)).first()
        return from_columns(tuple(row)) if row is not None else None

    def put_attempt(self, row: AttemptRow) -> None:
        self._c.execute(_UPSERT, to_columns(row))


class PostgresBackend(Backend):
    def __init__(self, url: URL, *, where: str, durability: str, readonly: bool) -> None:
        self.where = where
        self._durability = durability
        self._readonly = readonly
        self._engine: AsyncEngine = create_async_engine(url, pool_size=4, max_overflow=8)
        self._writer: AsyncConnection | None = None
        self._cache = ProjectionCache()

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
        return None

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            writer, self._writer = self._writer, None
            if writer is not None:
                try:
                    await writer.rollback()
                    await writer.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": WRITER_LOCK_KEY})
                    await writer.commit()
                except (DBAPIError, OSError):
                    pass  # the session ends below; the server releases the lock with it
                await writer.close()
            await self._engine.dispose()

    def _append_sync(self, conn: Connection, batch: Batch) -> None:
        try:
            with conn.begin():
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": APPEND_LOCK_KEY})
                written = apply_append(_PgTx(conn), batch, self._cache)
        except BaseException:
            self._cache.clear()
            raise
        self._cache.committed(written)

    async def append(self, batch: Batch) -> None:
        if self._writer is None:
            raise LedgerError(f"ledger {self.where} is not open for writing")
        try:
            with anyio.CancelScope(shield=True):
                await self._writer.run_sync(self._append_sync, batch)
        except IntegrityError:
            raise FencedError(
                f"ledger {self.where}: seq {batch.rows[0][0]} was taken by another writer; this "
                "writer is fenced and must stop making calls"
            ) from None
        except DBAPIError as error:
            raise self._error("append", error) from None

    async def replace_attempts(self, rows: Sequence[AttemptRow]) -> None:
        if self._writer is None:
            raise LedgerError(f"ledger {self.where} is not open for writing")

        self._cache.clear()

        def swap(conn: Connection) -> None:
            with conn.begin():
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": APPEND_LOCK_KEY})
                conn.execute(delete(attempts))
                if rows:
                    conn.execute(insert(attempts), [to_columns(r) for r in rows])

        with anyio.CancelScope(shield=True):
            await self._writer.run_sync(swap)

    async def _rows(self, statement: Any) -> list[tuple[Any, ...]]:
        try:
            async with self._engine.connect() as conn:
                result = await conn.execute(statement)
                return [tuple(row) for row in result.all()]
        except DBAPIError as error:
            raise self._error("read", error) from None

    async def head(self) -> RawEvent | None:
        rows = await self._rows(select(*_EVENT_COLS).order_by(events.c.seq.desc()).limit(1))
        return rows[0] if rows else None

    async def read_page(
        self, after: int, checkpoint_id: str | None, kinds: Sequence[str] | None, limit: int
    ) -> list[RawEvent]:
        statement = select(*_EVENT_COLS).where(events.c.seq > after)
        if checkpoint_id is not None:
            statement = statement.where(events.c.checkpoint_id == checkpoint_id)
        if kinds is not None:
            statement = statement.where(events.c.kind.in_(list(kinds)))
        return await self._rows(statement.order_by(events.c.seq).limit(limit))

    async def attempts(self, since: str | None, outcome: str | None) -> list[AttemptRow]:
        statement = select(*_ATTEMPT_COLS)
        if since is not None:
            statement = statement.where(attempts.c.started_at >= since)
        if outcome is not None:
            statement = statement.where(attempts.c.outcome == outcome)
        rows = await self._rows(statement.order_by(attempts.c.started_at, attempts.c.checkpoint_id))
        return [from_columns(row) for row in rows]

    async def attempt(self, checkpoint_id: str) -> AttemptRow | None:
        rows = await self._rows(select(*_ATTEMPT_COLS).where(attempts.c.checkpoint_id == checkpoint_id))
        return from_columns(rows[0]) if rows else None
