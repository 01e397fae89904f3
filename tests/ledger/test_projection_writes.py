"""What an append writes to the ``attempts`` projection, and that the rows stay what replay rebuilds.

A recorded call (``call.sent`` + ``call.replied``) writes no projection row: each append is the
events row and its checkpoint index entry (2 WAL frames on SQLite), and the next event touching
the attempt's row counts the calls sent since its ``last_seq``. Readers still see every call
(``Ledger.attempts`` adds those after ``last_seq``). When a row is written, only the columns it
changes are named, so SQLite rewrites no index entry the append leaves alone.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from quiesce.ledger import AppendItem, Ledger, downgrade_schema, replay_url, upgrade_schema
from quiesce.ledger.layout import HEAD_REVISION
from quiesce.ledger.projections import COLUMNS
from quiesce.ledger.sqlite import update_sql
from quiesce.tools.bench.ledger import wal_frames
from tests.ledger.helpers import COORDINATOR, FAILED, REPLIED, SENT, raw_sql, started

pytestmark = pytest.mark.anyio


def test_the_update_names_only_the_changed_columns() -> None:
    calls, failures, last = COLUMNS.index("calls"), COLUMNS.index("failures"), COLUMNS.index("last_seq")
    assert update_sql((calls, failures, last)) == (
        "UPDATE attempts SET calls = ?, failures = ?, last_seq = ? WHERE checkpoint_id = ?"
    )


async def test_a_recorded_call_writes_no_projection_page(tmp_path: Path) -> None:
    database = tmp_path / "l.db"
    url = f"sqlite+aiosqlite:///{database}"
    frames: dict[str, list[int]] = {"call.sent": [], "call.replied": []}
    async with Ledger.open(url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        for i in range(21):
            for kind, data in (("call.sent", SENT), ("call.replied", REPLIED)):
                before = wal_frames(database)
                await ledger.append(kind, checkpoint_id="c1", server="agent", call_id=f"c1/{i}", data=data)
                after = wal_frames(database)
                assert before is not None
                assert after is not None
                assert after > before
                frames[kind].append(after - before)
        stored = await ledger.attempt("c1", stored=True)
        live = await ledger.attempt("c1")
        assert stored is not None
        assert live is not None
        assert (stored.calls, live.calls, live.last_seq) == (0, 21, stored.last_seq)
        assert [row.calls for row in await ledger.attempts()] == [21]
        await ledger.append("call.sent", checkpoint_id="c1", server="agent", call_id="c1/x", data=SENT)
        await ledger.append("call.failed", checkpoint_id="c1", server="agent", call_id="c1/x", data=FAILED)
        failed = await ledger.attempt("c1", stored=True)
        await ledger.append("call.sent", checkpoint_id="c1", server="agent", call_id="c1/y", data=SENT)
        await ledger.append("phase.started", checkpoint_id="c1", data={"phase": "commit"})
        row = await ledger.attempt("c1", stored=True)
    # each: the events page and its checkpoint index page, no projection page
    assert statistics.median(frames["call.sent"]) == 2
    assert statistics.median(frames["call.replied"]) == 2
    assert failed is not None
    assert (failed.calls, failed.failures) == (22, 1), "the failure's event counted the 22 calls before it"
    assert row is not None
    assert (row.calls, row.failures, row.state) == (23, 1, "commit")
    report = await replay_url(url)
    assert report.ok, report.problem


async def test_calls_a_dead_writer_left_uncounted_are_counted_by_the_next_one(ledger_url: str) -> None:
    """A new writer has no cache: the calls stored after the row's ``last_seq`` are read from the
    events (SQLite: inside the append's transaction; PostgreSQL: with the row, before it)."""
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        await ledger.append("attempt.started", checkpoint_id="c2", data=started())
        for i in range(3):
            await ledger.append("call.sent", checkpoint_id="c1", server="agent", call_id=f"c1/{i}", data=SENT)
        await ledger.append("call.sent", checkpoint_id="c2", server="agent", call_id="c2/0", data=SENT)
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        assert [(r.checkpoint_id, r.calls) for r in await ledger.attempts()] == [("c1", 3), ("c2", 1)]
        assert [r.calls for r in await ledger.attempts(stored=True)] == [0, 0]
        # in one batch: a call of the batch before the touching event counts too, one after it waits
        await ledger.append_many(
            [
                _item("call.sent", "c1", "c1/3", SENT),
                _item("phase.started", "c1", None, {"phase": "commit"}),
                _item("call.sent", "c1", "c1/4", SENT),
            ]
        )
        stored = await ledger.attempt("c1", stored=True)
        await ledger.append("attempt.aborting", checkpoint_id="c2", data={"reason": "test"})
        c2 = await ledger.attempt("c2", stored=True)
    assert stored is not None
    assert (stored.calls, stored.state) == (4, "commit")
    assert c2 is not None
    assert c2.calls == 1
    report = await replay_url(ledger_url)
    assert report.ok, (report.problem, report.differences)


def _item(kind: str, cid: str, call_id: str | None, data: dict[str, Any]) -> AppendItem:
    return AppendItem(kind, cid, "agent" if call_id else None, call_id, data)


async def test_the_migration_rewrites_the_rows_whose_last_change_was_a_call(ledger_url: str) -> None:
    """0006 counted each ``call.sent`` in its row at once; 0007 with the next touching event. The
    downgrade gives the old rule's rows, the upgrade this rule's, and replay agrees at head."""
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        for cid in ("done", "dead"):
            await ledger.append("attempt.started", checkpoint_id=cid, data=started())
            await ledger.append("phase.started", checkpoint_id=cid, data={"phase": "prepare"})
            for i in range(3):
                await ledger.append(
                    "call.sent", checkpoint_id=cid, server="agent", call_id=f"{cid}/{i}", data=SENT
                )
                await ledger.append(
                    "call.replied", checkpoint_id=cid, server="agent", call_id=f"{cid}/{i}", data=REPLIED
                )
        await ledger.append("phase.completed", checkpoint_id="done", data={"phase": "prepare"})
        at_head = {r.checkpoint_id: r for r in await ledger.attempts(stored=True)}
        last_call = (await ledger.checkpoint_events(["dead"], ["call.sent"]))[-1].seq
    query = "SELECT checkpoint_id, calls, last_seq FROM attempts ORDER BY checkpoint_id"
    await downgrade_schema(ledger_url, "0006")
    old = {str(c): (int(n), int(s)) for c, n, s in await raw_sql(ledger_url, query)}
    assert old["dead"] == (3, last_call), "the old rule: every call counted, last_seq at the last one"
    assert old["done"] == (at_head["done"].calls, at_head["done"].last_seq) == (3, at_head["done"].last_seq)
    assert (await upgrade_schema(ledger_url))[1] == HEAD_REVISION
    new = {str(c): (int(n), int(s)) for c, n, s in await raw_sql(ledger_url, query)}
    assert new == {cid: (row.calls, row.last_seq) for cid, row in at_head.items()}
    assert new["dead"][0] == 0
    report = await replay_url(ledger_url)
    assert report.ok, (report.problem, report.differences)


async def test_every_row_read_counts_its_later_calls_over_many_attempts(ledger_url: str) -> None:
    """``attempts()`` adds each row's calls after its ``last_seq``, whatever the number of rows (the
    SQLite reads go 500 rows a query): attempt i has i % 4 calls not yet counted, and i % 3 counted."""
    count = 1203
    items: list[AppendItem] = []
    for i in range(count):
        cid = f"a{i:05d}"
        items.append(AppendItem("attempt.started", cid, None, None, started()))
        items += [_item("call.sent", cid, f"{cid}/c{k}", SENT) for k in range(i % 3)]
        items.append(AppendItem("phase.started", cid, None, None, {"phase": "prepare"}))
        items += [_item("call.sent", cid, f"{cid}/p{k}", SENT) for k in range(i % 4)]
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        for at in range(0, len(items), 997):
            await ledger.append_many(items[at : at + 997])
        rows = await ledger.attempts()
        stored = await ledger.attempts(stored=True)
    assert [r.calls for r in rows] == [i % 3 + i % 4 for i in range(count)]
    assert [r.calls for r in stored] == [i % 3 for i in range(count)]


async def test_records_alone_are_one_statement_each_and_atomic(tmp_path: Path) -> None:
    """A batch of call records only (a reply staged, carried by the next request's record) is one
    INSERT outside any explicit transaction: all of its rows or none. Past ``RECORDS_ALONE_MAX``
    rows, or with any other kind in it, the batch is a transaction as before."""
    import sqlite3

    from quiesce.ledger import FencedError
    from quiesce.ledger.backend import RECORDS_ALONE_MAX

    path = tmp_path / "q.db"
    statements: list[str] = []
    async with Ledger.open(f"sqlite+aiosqlite:///{path}") as writer:
        await writer.start_epoch(COORDINATOR)
        await writer.append("attempt.started", checkpoint_id="c1", data=started())
        writer.backend._w.set_trace_callback(statements.append)  # type: ignore[attr-defined]
        await writer.stage("call.replied", checkpoint_id="c1", server="a", call_id="c1/0", data=REPLIED)
        await writer.append("call.sent", checkpoint_id="c1", server="b", call_id="c1/1", data=SENT)
        # one statement (traced again for each firing of the insert-at-head trigger), two rows
        assert len(set(statements)) == 1, statements
        assert statements[0].startswith("INSERT INTO events")
        assert statements[0].count("), (") == 1
        statements.clear()
        for i in range(RECORDS_ALONE_MAX + 1):  # one row too many for a statement of its own
            await writer.stage(
                "call.replied", checkpoint_id="c1", server="a", call_id=f"c1/r{i}", data=REPLIED
            )
        await writer.append("call.sent", checkpoint_id="c1", server="b", call_id="c1/2", data=SENT)
        assert statements[0] == "BEGIN IMMEDIATE"
        assert statements[-1] == "COMMIT"
        statements.clear()
        await writer.stage("phase.started", checkpoint_id="c1", data={"phase": "commit"})
        await writer.append("call.sent", checkpoint_id="c1", server="b", call_id="c1/3", data=SENT)
        assert statements[0] == "BEGIN IMMEDIATE", "a phase event touches the attempt's row"
        writer.backend._w.set_trace_callback(None)  # type: ignore[attr-defined]
        head = await writer.head()
        assert head is not None
        # another writer's row at the head, chained correctly: the next batch of records is refused whole
        raw = sqlite3.connect(path, isolation_level=None)
        raw.execute(
            "INSERT INTO events (seq, at, kind, checkpoint_id, server, call_id, epoch, data, prev_hash, hash)"
            " VALUES (?, ?, 'call.sent', 'c1', 'x', 'x/1', ?, '{}', ?, ?)",
            (head.seq + 1, head.at, head.epoch, head.hash, "e" * 64),
        )
        raw.close()
        await writer.stage("call.replied", checkpoint_id="c1", server="b", call_id="c1/3", data=REPLIED)
        with pytest.raises(FencedError):
            await writer.append("call.sent", checkpoint_id="c1", server="b", call_id="c1/4", data=SENT)
    stored = (
        sqlite3.connect(path).execute("SELECT seq, call_id FROM events WHERE seq > ?", (head.seq,)).fetchall()
    )
    assert stored == [(head.seq + 1, "x/1")], "neither row of the refused batch went in"
