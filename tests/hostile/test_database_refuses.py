"""Append-only is the database's rule, on every write path, on SQLite and PostgreSQL alike.

Revision 0001 refuses UPDATE and DELETE (and TRUNCATE on PostgreSQL); revision 0003 refuses every
insert but the next row of the chain, which closes what 0001 left open on SQLite: `REPLACE INTO`
and `INSERT OR REPLACE` delete the row they collide with without firing a DELETE trigger. Each
statement below goes straight to the database (no Ledger in the way) and must be refused, with
the ledger unchanged after; the right next row is still accepted (the rule is not broader than
append-only). A database still at revision 0002 is refused with the command that upgrades it,
`quiesce db upgrade` brings it forward, and then REPLACE is refused there too.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy.exc import DBAPIError

from quiesce.ledger import Ledger, LedgerError, chain_hash, downgrade_schema, row_bytes
from quiesce.ledger.layout import HEAD_REVISION, VERSION_TABLE
from quiesce.tools.cli.main import main as cli
from tests.ledger.helpers import COORDINATOR, SENT, is_sqlite, raw_sql, started

pytestmark = pytest.mark.anyio

_COLUMNS = "seq, at, kind, checkpoint_id, server, call_id, epoch, data, prev_hash, hash"
_COPY_OF_2 = f"SELECT {_COLUMNS} FROM events WHERE seq = 2"
_EDITED_2 = (
    "SELECT seq, at, kind, checkpoint_id, server, call_id, epoch, '{\"edited\": 1}', prev_hash, hash"
    " FROM events WHERE seq = 2"
)

#: statement -> which backends it exists on
WRITE_PATHS: dict[str, tuple[str, ...]] = {
    "UPDATE events SET data = '{\"edited\": 1}' WHERE seq = 2": ("sqlite", "postgres"),
    "UPDATE events SET hash = prev_hash WHERE seq = 3": ("sqlite", "postgres"),
    "DELETE FROM events WHERE seq = 2": ("sqlite", "postgres"),
    "DELETE FROM events": ("sqlite", "postgres"),  # SQLite's TRUNCATE
    "TRUNCATE events": ("postgres",),
    f"REPLACE INTO events ({_COLUMNS}) {_EDITED_2}": ("sqlite",),
    f"INSERT OR REPLACE INTO events ({_COLUMNS}) {_EDITED_2}": ("sqlite",),
    f"INSERT OR IGNORE INTO events ({_COLUMNS}) {_EDITED_2}": ("sqlite",),
    (f"INSERT INTO events ({_COLUMNS}) {_EDITED_2} ON CONFLICT (seq) DO UPDATE SET data = excluded.data"): (
        "sqlite",
        "postgres",
    ),
    f"INSERT INTO events ({_COLUMNS}) {_COPY_OF_2} ON CONFLICT (seq) DO NOTHING": ("postgres",),
    (
        "MERGE INTO events AS e USING (SELECT 2 AS seq) AS s ON e.seq = s.seq"
        " WHEN MATCHED THEN UPDATE SET data = '{\"edited\": 1}'"
    ): ("postgres",),
    ("MERGE INTO events AS e USING (SELECT 2 AS seq) AS s ON e.seq = s.seq WHEN MATCHED THEN DELETE"): (
        "postgres",
    ),
    # a row slipped in out of order: at seq 0, past the head, or at the head with a wrong prev_hash
    (
        f"INSERT INTO events ({_COLUMNS}) SELECT 0, at, kind, checkpoint_id, server, call_id, epoch, data,"
        " prev_hash, hash FROM events WHERE seq = 1"
    ): ("sqlite", "postgres"),
    (
        f"INSERT INTO events ({_COLUMNS}) SELECT seq + 2, at, kind, checkpoint_id, server, call_id, epoch,"
        " data, hash, hash FROM events WHERE seq = 3"
    ): ("sqlite", "postgres"),
    (
        f"INSERT INTO events ({_COLUMNS}) SELECT seq + 1, at, kind, checkpoint_id, server, call_id, epoch,"
        " data, prev_hash, hash FROM events WHERE seq = 3"
    ): ("sqlite", "postgres"),
}


async def _three_events(url: str) -> list[tuple[Any, ...]]:
    async with Ledger.open(url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        await ledger.append("call.sent", checkpoint_id="c1", server="s", call_id="k1", data=SENT)
    return await raw_sql(url, f"SELECT {_COLUMNS} FROM events ORDER BY seq")


def _url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if backend == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    return str(request.getfixturevalue("postgres").create_database(f"t_{uuid.uuid4().hex[:20]}"))


@pytest.mark.parametrize(
    ("backend", "statement"),
    [
        pytest.param(backend, statement, marks=[pytest.mark.postgres] if backend == "postgres" else [])
        for statement, backends in WRITE_PATHS.items()
        for backend in backends
    ],
)
async def test_every_write_path_but_the_next_row_is_refused(
    backend: str, statement: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = _url(backend, request, tmp_path)
    before = await _three_events(url)
    with pytest.raises(DBAPIError, match="append-only"):
        await raw_sql(url, statement)
    assert await raw_sql(url, f"SELECT {_COLUMNS} FROM events ORDER BY seq") == before
    async with Ledger.open(url) as ledger:  # still a sound ledger a writer opens
        assert (await ledger.head()) is not None


async def test_the_next_row_of_the_chain_is_accepted(ledger_url: str) -> None:
    rows = await _three_events(ledger_url)
    seq, at, _, cid, _, _, epoch, _, _, digest = rows[-1]
    text = '{"note":"written by hand, chained correctly"}'
    new_hash = chain_hash(
        digest,
        row_bytes(seq=seq + 1, at=at, kind="phase.started", checkpoint_id=cid, server=None, call_id=None,
                  epoch=epoch, data_text=text, prev_hash=digest),
    )  # fmt: skip
    await raw_sql(
        ledger_url,
        f"INSERT INTO events ({_COLUMNS}) VALUES (:seq, :at, 'phase.started', :cid, NULL, NULL, :epoch,"
        " :data, :prev, :hash)",
        params={"seq": seq + 1, "at": at, "cid": cid, "epoch": epoch, "data": text, "prev": digest,
                "hash": new_hash},
    )  # fmt: skip
    assert len(await raw_sql(ledger_url, "SELECT seq FROM events")) == 4


async def test_an_old_schema_is_refused_and_db_upgrade_brings_it_forward(
    ledger_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = await _three_events(ledger_url)
    await downgrade_schema(ledger_url, "0002")  # a ledger written before revision 0003
    replace = (
        f"INSERT INTO events ({_COLUMNS}) {_EDITED_2} ON CONFLICT (seq) DO UPDATE SET data = excluded.data"
    )
    if is_sqlite(ledger_url):
        replace = f"REPLACE INTO events ({_COLUMNS}) {_EDITED_2}"
    for readonly in (False, True):
        with pytest.raises(LedgerError) as info:
            await Ledger.connect(ledger_url, readonly=readonly)
        assert f"quiesce db upgrade --ledger {ledger_url}" in str(info.value)
        assert "behind" in str(info.value)
    code = await anyio.to_thread.run_sync(cli, ["db", "upgrade", "--ledger", ledger_url])
    assert code == 0, capsys.readouterr().err
    assert f"0002 -> {HEAD_REVISION}" in capsys.readouterr().out
    assert await raw_sql(ledger_url, f"SELECT version_num FROM {VERSION_TABLE}") == [(HEAD_REVISION,)]
    with pytest.raises(DBAPIError, match="append-only"):
        await raw_sql(ledger_url, replace)
    assert await raw_sql(ledger_url, f"SELECT {_COLUMNS} FROM events ORDER BY seq") == rows
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        assert (await ledger.head()) is not None


async def test_revision_0003_downgrades_cleanly(ledger_url: str) -> None:
    """Without 0003 the 0001 triggers still hold (REPLACE is the hole 0003 closes on SQLite)."""
    await _three_events(ledger_url)
    await downgrade_schema(ledger_url, "0002")
    with pytest.raises(DBAPIError, match="append-only"):
        await raw_sql(ledger_url, "DELETE FROM events WHERE seq = 2")
    if is_sqlite(ledger_url):
        await raw_sql(ledger_url, f"REPLACE INTO events ({_COLUMNS}) {_EDITED_2}")  # the hole, at 0002
        assert await raw_sql(ledger_url, "SELECT data FROM events WHERE seq = 2") == [('{"edited": 1}',)]
    await downgrade_schema(ledger_url, "base")


def test_the_sqlite_trigger_text_is_the_migrations(tmp_path: Path) -> None:
    """The trigger is installed by alembic at head on a new SQLite ledger (not by hand)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"

    async def go() -> list[tuple[Any, ...]]:
        async with Ledger.open(url):
            pass
        return await raw_sql(url, "SELECT name FROM sqlite_master WHERE type = 'trigger' ORDER BY name")

    names = [row[0] for row in anyio.run(go)]
    assert names == ["events_insert_at_head", "events_no_delete", "events_no_update"]
