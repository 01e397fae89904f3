"""The SQLite reads of a rollout's lineage, written once for two transports.

``LineageReads`` holds the queries ``quiesce.ledger.rollout_refs.read_rollout_lineage`` needs (the
``rollout_refs`` projection, events by seq, a checkpoint's events of some kinds, the first marker
event in each seq range, the last marker event before each seq), over one abstract
``_query(sql, params)``: ``quiesce.ledger.sqlite.SqliteBackend`` runs it on its read connection in
a worker thread; ``FileReader`` runs it on the calling thread.

``read_rollout_lineage_now`` is the cold command's path (``quiesce rollouts --rollout ID``): no
event loop, no thread, no SQLAlchemy — standard library and quiesce's ledger modules that import
nothing else. The coroutine it drives never suspends (every await it makes is one of
``FileReader``'s, which return at once), so it runs to completion with one ``send``. It answers
only a ledger file at the head schema revision; anything else is left to the full ``Ledger``
(``None``), which says what is wrong.
"""

from __future__ import annotations

import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

from quiesce.ledger import sqlitefile
from quiesce.ledger.errors import LedgerError
from quiesce.ledger.events import Event, event_from_raw
from quiesce.ledger.layout import (
    EVENT_COLUMNS,
    HEAD_REVISION,
    MARKER_WHERE_SQLITE,
    VERSION_TABLE,
    indexed_kind,
)
from quiesce.ledger.lineage import LineageReport

__all__ = ["FileReader", "LineageReads", "first_in_ranges_sql", "last_before_sql", "read_rollout_lineage_now"]

#: Parameters per statement at most (SQLite's default limit is 999 host parameters before 3.32).
CHUNK: Final = 500
_NO_BOUND: Final = 2**63 - 1
_EV_COLS: Final = ", ".join(EVENT_COLUMNS)

Row = tuple[object, ...]


def marks(n: int) -> str:
    """``n`` SQL parameter marks."""
    return ", ".join("?" * n)


def first_in_ranges_sql(kinds: int, ranges: int) -> str:
    """``first_in_ranges``'s query: per range ``(i, lo, hi)`` one marker-index lookup per kind."""
    firsts = ", ".join(
        f"(SELECT seq FROM events WHERE kind = ? AND seq > g.lo AND seq < g.hi AND {MARKER_WHERE_SQLITE}"
        " ORDER BY seq LIMIT 1)"
        for _ in range(kinds)
    )
    values = ", ".join("(?, ?, ?)" for _ in range(ranges))
    return f"WITH g(i, lo, hi) AS (VALUES {values}) SELECT i, {firsts} FROM g ORDER BY i"


def last_before_sql(seqs: int) -> str:
    """``last_before_each``'s query: per seq one backward marker-index lookup."""
    values = ", ".join("(?, ?)" for _ in range(seqs))
    return (
        f"WITH g(i, x) AS (VALUES {values}) SELECT i, (SELECT seq FROM events WHERE kind = ? AND seq < g.x"
        f" AND {MARKER_WHERE_SQLITE} ORDER BY seq DESC LIMIT 1) FROM g ORDER BY i"
    )


class LineageReads(ABC):
    """The lineage queries over ``_query`` (rows of the events table as stored: ``RawEvent``)."""

    @abstractmethod
    async def _query(self, sql: str, params: Sequence[object]) -> list[Row]:
        """The rows of ``sql`` run with ``params`` (the transport: a worker thread, or in place)."""

    async def _chunked(
        self, sql_of: Callable[[int], str], items: Sequence[object], tail: Sequence[object] = ()
    ) -> list[Row]:
        """``sql_of(n)`` run per chunk of ``items`` (its ``n`` parameters, then ``tail``), rows joined."""
        out: list[Row] = []
        for start in range(0, len(items), CHUNK):
            chunk = items[start : start + CHUNK]
            out.extend(await self._query(sql_of(len(chunk)), [*chunk, *tail]))
        return out

    async def rollout_ref_seqs(self, rollout_ids: Sequence[str]) -> list[int]:
        rows = await self._chunked(
            lambda n: f"SELECT DISTINCT seq FROM rollout_refs WHERE rollout_id IN ({marks(n)})",
            list(rollout_ids),
        )
        return sorted({int(row[0]) for row in rows})  # type: ignore[call-overload]

    async def events_at(self, seqs: Sequence[int]) -> list[Any]:
        rows = await self._chunked(
            lambda n: f"SELECT {_EV_COLS} FROM events WHERE seq IN ({marks(n)}) ORDER BY seq", list(seqs)
        )
        return sorted(rows, key=lambda row: row[0])

    async def checkpoint_rows(self, checkpoint_ids: Sequence[str], kinds: Sequence[str]) -> list[Any]:
        if not kinds:
            return []
        rows = await self._chunked(
            lambda n: (
                f"SELECT {_EV_COLS} FROM events WHERE checkpoint_id IN ({marks(n)})"
                f" AND kind IN ({marks(len(kinds))}) ORDER BY seq"
            ),
            list(checkpoint_ids),
            list(kinds),
        )
        return sorted(rows, key=lambda row: row[0])

    async def first_in_ranges(
        self, kinds: Sequence[str], ranges: Sequence[tuple[int, int | None]]
    ) -> list[int | None]:
        if not kinds or not ranges:
            return [None] * len(ranges)
        out: list[int | None] = []
        for start in range(0, len(ranges), CHUNK // 3):
            chunk = ranges[start : start + CHUNK // 3]
            params: list[object] = []
            for i, (lo, hi) in enumerate(chunk):
                params += [i, lo, _NO_BOUND if hi is None else hi]
            rows = await self._query(first_in_ranges_sql(len(kinds), len(chunk)), [*params, *kinds])
            out += [min((int(s) for s in row[1:] if s is not None), default=None) for row in rows]  # type: ignore[call-overload]
        return out

    async def last_before_each(self, kind: str, seqs: Sequence[int]) -> list[int | None]:
        out: list[int | None] = []
        for start in range(0, len(seqs), CHUNK // 2):
            chunk = seqs[start : start + CHUNK // 2]
            params: list[object] = [x for i, seq in enumerate(chunk) for x in (i, seq)]
            rows = await self._query(last_before_sql(len(chunk)), [*params, kind])
            out += [None if row[1] is None else int(row[1]) for row in rows]  # type: ignore[call-overload]
        return out


class FileReader(LineageReads):
    """``read_rollout_lineage``'s reads (``rollout_refs._Reads``) on one read-only ``sqlite3``
    connection, on the calling thread: each coroutine returns without suspending."""

    def __init__(self, conn: sqlite3.Connection, where: str) -> None:
        self._conn = conn
        self._where = where

    async def _query(self, sql: str, params: Sequence[object]) -> list[Row]:
        try:
            return self._conn.execute(sql, params).fetchall()
        except sqlite3.Error as error:
            raise LedgerError(f"ledger {self._where}: read failed: {error}") from None

    async def events_at(self, seqs: Sequence[int]) -> list[Event]:
        return [event_from_raw(raw) for raw in await super().events_at(seqs)] if seqs else []

    async def checkpoint_events(self, checkpoint_ids: Sequence[str], kinds: Sequence[str]) -> list[Event]:
        if not checkpoint_ids or not kinds:
            return []
        return [event_from_raw(raw) for raw in await self.checkpoint_rows(checkpoint_ids, kinds)]

    async def first_in_ranges(
        self, kinds: Sequence[str], ranges: Sequence[tuple[int, int | None]]
    ) -> list[int | None]:
        if not all(indexed_kind(kind) for kind in kinds):
            raise LedgerError(f"first_in_ranges reads marker kinds only, not {list(kinds)}")
        return await super().first_in_ranges(kinds, ranges)

    async def last_before_each(self, kind: str, seqs: Sequence[int]) -> list[int | None]:
        if not indexed_kind(kind):
            raise LedgerError(f"last_before_each reads a marker kind only, not {kind!r}")
        return await super().last_before_each(kind, seqs) if seqs else []


def _run(coro: Coroutine[Any, Any, LineageReport]) -> LineageReport:
    """The result of a coroutine that never suspends, without an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        result: LineageReport = done.value
        return result
    coro.close()
    raise RuntimeError("a loop-free lineage read suspended")  # only if an await did real I/O


def read_rollout_lineage_now(path: Path, rollout_ids: Iterable[str]) -> LineageReport | None:
    """``read_rollout_lineage`` of the ledger file at ``path`` on this thread, or None when this path
    does not answer it (not a ledger at the head revision, or the file cannot be read): the caller
    then opens the ``Ledger``, which says why."""
    from quiesce.ledger.rollout_refs import read_rollout_lineage

    try:
        conn = sqlitefile.connect_reader(path)
    except sqlite3.Error:
        return None
    try:
        try:
            version = conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall()
        except sqlite3.Error:
            return None
        if [tuple(row) for row in version] != [(HEAD_REVISION,)]:
            return None
        conn.execute("BEGIN")  # one snapshot for every query, whatever a writer appends meanwhile
        return _run(read_rollout_lineage(FileReader(conn, str(path)), rollout_ids))
    finally:
        conn.close()
