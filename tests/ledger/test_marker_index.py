"""Revision 0004: the kind index holds the marker events only, and lookups by kind still use it.

Per-call and per-phase events (``call.*``, ``phase.*``) are nine events in ten; they are kept out
of the kind index so a save's transactions write no page of it. A lookup of a marker kind
(``Ledger.last_before``) must still be one index lookup on both databases, whatever the history,
and must find the same events as before for every kind, indexed or not.
"""

from __future__ import annotations

from typing import Any

import anyio.to_thread
import pytest
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect

from quiesce.ledger import AppendItem, Ledger, downgrade_schema
from quiesce.ledger.layout import MARKER_WHERE_SQLITE, indexed_kind
from quiesce.ledger.postgres import read_last_statement
from quiesce.ledger.sqlite import read_last_sql
from quiesce.tools.cli.main import main as cli
from tests.ledger.helpers import REPLIED, SENT, is_sqlite, raw_sql, started

pytestmark = pytest.mark.anyio

CALLS_PER_ATTEMPT = 600
ATTEMPTS = 5


async def _history(url: str) -> dict[str, list[int]]:
    """``ATTEMPTS`` attempts, each a started marker, many calls and a completed marker; the seqs
    of each kind, in order."""
    seqs: dict[str, list[int]] = {}
    async with Ledger.open(url) as ledger:
        for a in range(ATTEMPTS):
            cid = f"c{a}"
            items = [AppendItem("attempt.started", checkpoint_id=cid, data=started())]
            items += [AppendItem("phase.started", checkpoint_id=cid, data={"phase": "prepare"})]
            for i in range(CALLS_PER_ATTEMPT // 2):
                call = {"checkpoint_id": cid, "server": "s", "call_id": f"{cid}/{i}"}
                items += [
                    AppendItem("call.sent", data=SENT, **call),
                    AppendItem("call.replied", data=REPLIED, **call),
                ]
            items += [
                AppendItem(
                    "attempt.completed", checkpoint_id=cid, data={"outcome": "published", "servers": ["s"]}
                )
            ]
            for event in await ledger.append_many(items):
                seqs.setdefault(event.kind, []).append(event.seq)
    return seqs


async def _plan(url: str, kind: str, before: int) -> str:
    """The database's plan for ``read_last(kind, before)``, as text."""
    if is_sqlite(url):
        # the backend's own text with its two parameters bound, as it runs it
        sql = read_last_sql(kind).replace("kind = ?", "kind = :kind").replace("seq < ?", "seq < :before")
        rows = await raw_sql(url, f"EXPLAIN QUERY PLAN {sql}", params={"kind": kind, "before": before})
    else:
        compiled = read_last_statement(kind, before).compile(
            dialect=asyncpg_dialect(),  # type: ignore[no-untyped-call]  # the ledger's driver: % stays as is
            compile_kwargs={"literal_binds": True},
        )
        rows = await raw_sql(url, "ANALYZE events", f"EXPLAIN {compiled}")
    return "\n".join(" ".join(str(c) for c in row) for row in rows)


async def _index_definitions(url: str) -> dict[str, str]:
    if is_sqlite(url):
        rows = await raw_sql(
            url, "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'events'"
        )
    else:
        rows = await raw_sql(url, "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'events'")
    return {str(name): str(sql) for name, sql in rows if sql is not None}


async def test_the_kind_index_is_partial_and_last_before_is_one_lookup_in_it(ledger_url: str) -> None:
    seqs = await _history(ledger_url)
    indexes = await _index_definitions(ledger_url)
    assert "ix_events_kind" not in indexes
    marker = indexes["ix_events_marker"]
    if is_sqlite(ledger_url):
        assert MARKER_WHERE_SQLITE in marker
    else:
        assert "WHERE" in marker
        assert "'call.%'" in marker
        assert "'phase.%'" in marker

    head = seqs["attempt.completed"][-1] + 1
    for kind in ("attempt.started", "attempt.completed"):
        assert indexed_kind(kind)
        plan = await _plan(ledger_url, kind, head)
        assert "ix_events_marker" in plan, plan
    for kind in ("call.sent", "phase.started"):
        assert not indexed_kind(kind)
        assert "ix_events_marker" not in await _plan(ledger_url, kind, head), kind


async def test_last_before_finds_the_same_events_for_indexed_and_unindexed_kinds(ledger_url: str) -> None:
    seqs = await _history(ledger_url)
    async with Ledger.open(ledger_url, readonly=True) as ledger:
        for kind, found in seqs.items():
            for probe in (found[0], found[len(found) // 2], found[-1], found[-1] + 1):
                earlier = [s for s in found if s < probe]
                event = await ledger.last_before(kind, probe)
                assert (event.seq if event is not None else None) == (earlier[-1] if earlier else None)
                if event is not None:
                    assert event.kind == kind
        assert await ledger.last_before("attempt.aborted", 10**9) is None
        assert await ledger.last_before("call.failed", 10**9) is None
        markers = [e.seq async for e in ledger.read(kinds=["attempt.started", "attempt.completed"])]
        assert markers == sorted(seqs["attempt.started"] + seqs["attempt.completed"])


async def test_revision_0004_downgrades_to_the_full_index_and_upgrades_back(ledger_url: str) -> None:
    seqs = await _history(ledger_url)
    before: list[Any] = await raw_sql(ledger_url, "SELECT seq, hash FROM events ORDER BY seq")
    await downgrade_schema(ledger_url, "0003")
    indexes = await _index_definitions(ledger_url)
    assert "ix_events_kind" in indexes
    assert "ix_events_marker" not in indexes
    assert await _run(["db", "upgrade", "--ledger", ledger_url]) == 0
    assert "ix_events_marker" in await _index_definitions(ledger_url)
    assert await raw_sql(ledger_url, "SELECT seq, hash FROM events ORDER BY seq") == before
    async with Ledger.open(ledger_url, readonly=True) as ledger:
        event = await ledger.last_before("attempt.started", seqs["attempt.started"][-1])
        assert event is not None
        assert event.seq == seqs["attempt.started"][-2]


async def _run(argv: list[str]) -> int:
    """The CLI runs its own event loop: call it from a worker thread."""
    return await anyio.to_thread.run_sync(cli, argv)
