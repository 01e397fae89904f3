"""Replay (chain verification, projection rebuild), the schema rules, and their CLI commands."""

from __future__ import annotations

import json
import random
from typing import Any

import anyio
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.ext.asyncio import create_async_engine

from quiesce.ledger import Ledger, LedgerError, downgrade_schema, replay_url
from quiesce.ledger.layout import HEAD_REVISION
from quiesce.ledger.schema import VERSION_TABLE, metadata
from quiesce.tools.cli.main import main as cli
from tests.ledger.helpers import (
    COORDINATOR,
    SENT,
    drop_triggers_sql,
    is_sqlite,
    random_items,
    raw_sql,
    started,
)

pytestmark = pytest.mark.anyio


async def _fill(url: str, n: int = 30) -> None:
    async with Ledger.open(url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        for i in range(n - 2):
            await ledger.append("call.sent", checkpoint_id="c1", server="s", call_id=f"k{i}", data=SENT)


def _cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = cli(list(argv))
    out = capsys.readouterr().out
    return code, json.loads(out)


async def _run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    # The CLI runs its own event loop (anyio.run), so call it from a worker thread.
    code = await anyio.to_thread.run_sync(cli, list(argv))
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


async def test_replay_of_a_sound_ledger(ledger_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    await _fill(ledger_url)
    # Without --verify: --verify also runs the audit's protocol check, which these synthetic events fail.
    code, doc = await _run_cli(capsys, "replay", "--ledger", ledger_url, "--json")
    assert code == 0
    async with Ledger.open(ledger_url, readonly=True) as ledger:
        head = await ledger.head()
    assert head is not None
    assert doc == {
        "events": 30,
        "head_seq": 30,
        "head_hash": head.hash,
        "chain": {"ok": True, "first_bad_seq": None, "problem": None},
        "projections": {"ok": True, "differences": []},
        "rebuilt": False,
    }


async def test_an_edited_row_is_found_with_its_seq(
    ledger_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await _fill(ledger_url)
    await raw_sql(
        ledger_url,
        *drop_triggers_sql(ledger_url),
        "UPDATE events SET data = REPLACE(data, 'prepare', 'commit') WHERE seq = 17",
    )
    report = await replay_url(ledger_url)
    assert (report.chain_ok, report.first_bad_seq) == (False, 17)
    assert report.problem is not None
    assert "hash mismatch" in report.problem
    code, doc = await _run_cli(capsys, "replay", "--ledger", ledger_url, "--json")
    assert code == 1
    assert doc["chain"] == {"ok": False, "first_bad_seq": 17, "problem": report.problem}
    code = await anyio.to_thread.run_sync(cli, ["replay", "--ledger", ledger_url, "--rebuild"])
    assert code == 1, "no rebuild from a broken chain"


async def test_a_rewritten_hash_is_found_by_the_next_row(ledger_url: str) -> None:
    await _fill(ledger_url)
    await raw_sql(
        ledger_url, *drop_triggers_sql(ledger_url), "UPDATE events SET hash = prev_hash WHERE seq = 9"
    )
    report = await replay_url(ledger_url)
    assert report.first_bad_seq in (9, 10)


async def test_a_deleted_row_is_found(ledger_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    await _fill(ledger_url)
    await raw_sql(ledger_url, *drop_triggers_sql(ledger_url), "DELETE FROM events WHERE seq = 12")
    code, doc = await _run_cli(capsys, "replay", "--ledger", ledger_url, "--verify", "--json")
    assert code == 1
    assert doc["chain"]["first_bad_seq"] == 12
    assert "missing" in doc["chain"]["problem"]
    assert doc["events"] == 29


async def test_rebuild_after_10000_random_events_gives_the_live_projection(
    ledger_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(20250101)
    items = random_items(rng, 10_000)
    async with Ledger.open(ledger_url, durability="process") as ledger:
        await ledger.start_epoch(COORDINATOR)
        position = 0
        while position < len(items):
            size = rng.choice([1, 1, 2, 7, 50, 300])
            chunk = items[position : position + size]
            position += size
            if size == 1:
                it = chunk[0]
                await ledger.append(
                    it.kind,
                    checkpoint_id=it.checkpoint_id,
                    server=it.server,
                    call_id=it.call_id,
                    data=it.data,
                )
            else:
                await ledger.append_many(chunk)
            if rng.random() < 0.01:
                await ledger.start_epoch(COORDINATOR)
        live = await ledger.attempts()
    assert len(live) > 100
    assert {r.state for r in live} >= {"aborted", "completed", "abandoned"}
    assert any(r.outcome is None for r in live), "some attempts are still running"

    report = await replay_url(ledger_url)
    assert report.ok, report.differences[:5]

    # damage the projection: replay names the differences; --rebuild restores exactly the live rows
    victim = live[len(live) // 2].checkpoint_id
    await raw_sql(
        ledger_url,
        "UPDATE attempts SET state = 'bogus', calls = calls + 5 WHERE checkpoint_id = :c",
        "DELETE FROM attempts WHERE checkpoint_id = :d",
        params={"c": victim, "d": live[0].checkpoint_id},
    )
    code, doc = await _run_cli(capsys, "replay", "--ledger", ledger_url, "--verify", "--json")
    assert code == 1
    assert doc["chain"]["ok"] is True
    assert sorted((d["checkpoint_id"], d["column"]) for d in doc["projections"]["differences"]) == sorted(
        [(victim, "state"), (victim, "calls"), (live[0].checkpoint_id, "(row)")]
    )
    code, doc = await _run_cli(capsys, "replay", "--ledger", ledger_url, "--rebuild", "--json")
    assert code == 0
    assert doc["rebuilt"] is True
    async with Ledger.open(ledger_url, readonly=True) as ledger:
        assert await ledger.attempts() == live
    assert (await replay_url(ledger_url)).ok


async def test_rebuild_needs_the_writer(ledger_url: str) -> None:
    await _fill(ledger_url, 5)
    async with Ledger.open(ledger_url):
        code = await anyio.to_thread.run_sync(cli, ["replay", "--ledger", ledger_url, "--rebuild"])
        assert code == 1


# -- schema ------------------------------------------------------------------------------------


async def test_schema_matches_the_table_definitions(ledger_url: str) -> None:
    async with Ledger.open(ledger_url):
        pass
    engine = create_async_engine(ledger_url)
    try:
        async with engine.connect() as conn:

            def diff(sync_conn: Any) -> list[Any]:
                context = MigrationContext.configure(sync_conn, opts={"version_table": VERSION_TABLE})
                return [d for d in compare_metadata(context, metadata) if d[0] != "remove_table"]

            assert await conn.run_sync(diff) == []
    finally:
        await engine.dispose()


async def test_schema_behind_is_refused_and_db_upgrade_fixes_it(
    ledger_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await _fill(ledger_url, 3)
    await downgrade_schema(ledger_url, "base")
    with pytest.raises(LedgerError) as info:
        await Ledger.connect(ledger_url)
    message = str(info.value)
    assert f"quiesce db upgrade --ledger {ledger_url}" in message
    assert "behind" in message
    with pytest.raises(LedgerError, match="behind"):
        await Ledger.connect(ledger_url, readonly=True)

    code, doc = await _run_cli(capsys, "db", "upgrade", "--ledger", ledger_url, "--json")
    assert code == 0
    assert doc == {
        "ledger": ledger_url,
        "before": None,
        "after": HEAD_REVISION,
        "changed": True,
        "restored_triggers": [],
    }
    code, doc = await _run_cli(capsys, "db", "upgrade", "--ledger", ledger_url, "--json")
    assert (code, doc["changed"]) == (0, False)
    async with Ledger.open(ledger_url) as ledger:
        ev = await ledger.append("call.sent", call_id="k", data=SENT)
        assert ev.seq == 1


async def test_schema_ahead_is_refused(ledger_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    await _fill(ledger_url, 3)
    await raw_sql(ledger_url, f"UPDATE {VERSION_TABLE} SET version_num = 'f00dfeed'")
    for readonly in (False, True):
        with pytest.raises(LedgerError, match="upgrade quiesce") as info:
            await Ledger.connect(ledger_url, readonly=readonly)
        assert "f00dfeed" in str(info.value)
    code = await anyio.to_thread.run_sync(cli, ["db", "upgrade", "--ledger", ledger_url])
    assert code == 1
    assert "upgrade quiesce" in capsys.readouterr().err


async def test_empty_database_is_created_at_head_by_a_writer_only(ledger_url: str) -> None:
    with pytest.raises(LedgerError, match="no ledger"):
        await Ledger.connect(ledger_url, readonly=True)
    async with Ledger.open(ledger_url) as ledger:
        assert await ledger.head() is None
    rows = await raw_sql(ledger_url, f"SELECT version_num FROM {VERSION_TABLE}")
    assert rows == [(HEAD_REVISION,)]


async def test_messages_never_show_a_password(ledger_url: str) -> None:
    if is_sqlite(ledger_url):
        pytest.skip("SQLite URLs carry no password")
    with_password = ledger_url.replace("quiesce@", "quiesce:hunter2-pw@")
    await downgrade_schema(ledger_url, "base")  # creates nothing; leaves an empty version table
    with pytest.raises(LedgerError) as info:
        await Ledger.connect(with_password)
    assert "hunter2-pw" not in str(info.value)
    assert "***" in str(info.value)
    wrong_port = with_password.rsplit(":", 1)[0].rsplit(":", 1)[0] + ":hunter2-pw@127.0.0.1:1/x"
    with pytest.raises(LedgerError) as info:
        await Ledger.connect(wrong_port)
    assert "hunter2-pw" not in str(info.value)
