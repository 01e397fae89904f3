"""A worker process of a parallel SQLite replay: checks ranges of seqs of one ledger file.

``quiesce.ledger.replay`` starts it as ``python -c ... PATH`` (see ``command``). Protocol: one request
per line on stdin, the JSON ``[lo, hi]`` for the rows with ``lo < seq <= hi``; one answer per
request on stdout, a pickled ``("ok", Chunk)`` or ``("error", text)`` preceded by its length (8
bytes, little-endian). End of input ends the process.

Each range is read by one query on one read-only connection, so it is one consistent snapshot;
the chain is checked by ``quiesce.ledger.chain.check_rows`` with the range's first row left unlinked
(``Chunk.first`` lets the parent link it), and ``quiesce.ledger.projections.FoldFeed`` reduces the rows
to fold items, which the parent folds in seq order. An item holds only what ``fold`` reads of its
events (``quiesce.ledger.projections.FoldItem``: no hashes, no payload text; the payloads fold reads are
decoded here, in parallel), so the answers stay small and the parent's share of the work is the
fold alone. Memory: one page of rows at a time, plus the range's fold items.
"""

from __future__ import annotations

import gc
import json
import pickle
import sqlite3
import struct
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from quiesce.ledger import sqlitefile
from quiesce.ledger.chain import Problem, check_rows
from quiesce.ledger.layout import EVENT_COLUMNS
from quiesce.ledger.projections import FoldFeed, FoldItem

#: Rows fetched and checked at a time: a page and the texts hashed from it stay in the CPU's cache
#: (measured: about 20% less CPU per row than pages of 5,000).
PAGE_SIZE = 256
HEADER = struct.Struct("<Q")
_RANGE = f"SELECT {', '.join(EVENT_COLUMNS)} FROM events WHERE seq > ? AND seq <= ? ORDER BY seq"


@dataclass(frozen=True, slots=True)
class Chunk:
    """What a range of seqs holds: ``first`` = (seq, prev_hash) and ``last`` = (seq, hash) of its
    first and last rows (None when empty), its first problem with the first row unlinked, and
    its fold items (``FoldFeed``: folded in order, they give the rows ``fold`` over every event of
    the range gives)."""

    count: int
    first: tuple[int, str] | None
    last: tuple[int, str] | None
    problem: Problem | None
    items: list[FoldItem]


def check_range(conn: sqlite3.Connection, lo: int, hi: int, page_size: int = PAGE_SIZE) -> Chunk:
    """The ``Chunk`` of the rows with ``lo < seq <= hi``."""
    cursor = conn.execute(_RANGE, (lo, hi))
    feed = FoldFeed()
    count = 0
    first: tuple[int, str] | None = None
    last: tuple[int, str] | None = None
    problem: Problem | None = None
    while rows := cursor.fetchmany(page_size):
        if first is None:
            first = (rows[0][0], rows[0][8])
        if problem is None:
            problem = check_rows(rows, last)
        last = (rows[-1][0], rows[-1][9])
        count += len(rows)
        feed.add(rows)
    return Chunk(count, first, last, problem, feed.take())


def bounds(conn: sqlite3.Connection) -> tuple[int, int] | None:
    """The smallest and the largest seq stored (None when ``events`` is empty)."""
    # Two subqueries: SQLite answers a lone min() or max() from the index end, not a pair of them.
    low, high = conn.execute("SELECT (SELECT min(seq) FROM events), (SELECT max(seq) FROM events)").fetchone()
    return None if low is None else (int(low), int(high))


def command(path: Path) -> list[str]:
    """The command line of a worker for the ledger file at ``path``: this same ``quiesce`` package
    (the folder that holds it first on the path), and no ``site`` (the worker needs only the
    standard library, and starts faster without)."""
    root = str(Path(__file__).parents[2])
    code = f"import sys; sys.path.insert(0, {root!r}); from quiesce.ledger.replay_worker import main; main()"
    return [sys.executable, "-S", "-c", code, str(path)]


def connect(path: str) -> sqlite3.Connection:
    """A read-only connection to the ledger file at ``path`` (never creates nor writes it; on a
    read-only filesystem too: ``quiesce.ledger.sqlitefile.read_uri``)."""
    return sqlitefile.connect_reader(sqlitefile.resolve(path))


def main() -> None:
    gc.disable()  # short-lived, builds no cycles; collections would only cost time
    out = sys.stdout.buffer
    conn: sqlite3.Connection | None = None
    for line in sys.stdin.buffer:
        try:
            lo, hi = json.loads(line)
            if conn is None:
                conn = connect(sys.argv[1])
            answer: tuple[str, object] = ("ok", check_range(conn, int(lo), int(hi)))
        except Exception:
            answer = ("error", traceback.format_exc())
        data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        out.write(HEADER.pack(len(data)))
        out.write(data)
        out.flush()
    if conn is not None:
        conn.close()
