"""The append-only triggers, on both databases: a writer refuses a ledger that lacks one (nothing is
written), readers still read it, and `quiesce db upgrade` puts them back."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from quiesce.ledger import Ledger, LedgerError, restore_triggers
from quiesce.ledger.layout import APPEND_ONLY_TRIGGERS
from tests.hostile.helpers import no_traceback, run_cli
from tests.ledger.helpers import COORDINATOR, SENT, drop_triggers_sql, is_sqlite, raw_sql

pytestmark = pytest.mark.anyio


async def _fill(url: str) -> None:
    async with Ledger.open(url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        for i in range(5):
            await ledger.append("call.sent", checkpoint_id="c", server="m", call_id=f"k{i}", data=SENT)


async def _count(url: str) -> int:
    return int((await raw_sql(url, "SELECT count(*) FROM events"))[0][0])


async def test_a_writer_refuses_a_ledger_whose_triggers_were_dropped(ledger_url: str) -> None:
    await _fill(ledger_url)
    dropped = drop_triggers_sql(ledger_url)[2]  # the insert-at-head trigger alone
    await raw_sql(ledger_url, dropped)
    with pytest.raises(LedgerError) as refused:
        await Ledger.connect(ledger_url)
    message = str(refused.value)
    assert "append-only trigger events_insert_at_head on its events table is missing" in message
    assert f"quiesce replay --verify --ledger {ledger_url}" in message
    assert f"quiesce db upgrade --ledger {ledger_url}" in message
    assert "nothing was written" in message
    assert await _count(ledger_url) == 6
    async with Ledger.open(ledger_url, readonly=True) as reader:  # reading is still allowed
        assert len([e async for e in reader.read()]) == 6

    await raw_sql(ledger_url, *drop_triggers_sql(ledger_url)[:2])  # now all three
    with pytest.raises(LedgerError, match=r"triggers .* are missing") as refused:
        await Ledger.connect(ledger_url)
    for name in APPEND_ONLY_TRIGGERS["sqlite" if is_sqlite(ledger_url) else "postgresql"]:
        assert name in str(refused.value)

    restored = await restore_triggers(ledger_url)
    assert restored == list(APPEND_ONLY_TRIGGERS["sqlite" if is_sqlite(ledger_url) else "postgresql"])
    assert await restore_triggers(ledger_url) == []  # nothing left to restore
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        event = await ledger.append("call.sent", checkpoint_id="c", server="m", call_id="k9", data=SENT)
        assert event.seq == 8
    with pytest.raises(Exception, match="append-only"):  # the restored triggers refuse again
        await raw_sql(ledger_url, "UPDATE events SET kind = 'x' WHERE seq = 2")
    with pytest.raises(Exception, match="append-only"):
        await raw_sql(ledger_url, "DELETE FROM events WHERE seq = 8")


def test_the_cli_names_the_way_out_and_db_upgrade_restores(tmp_path: Path) -> None:
    """Through the real CLI: a command that writes is refused in one line (no traceback, nothing
    appended); `quiesce db upgrade` reports the triggers it restored; then the command runs."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_fill, url)
    anyio.run(lambda: raw_sql(url, *drop_triggers_sql(url)))
    config = tmp_path / "cluster.yaml"
    config.write_text(f"ledger: {url}\nservers:\n  - {{name: m, url: 'http://127.0.0.1:9'}}\n")
    recover = run_cli("recover", "--config", str(config))
    assert recover.returncode != 0
    no_traceback(recover)
    assert "append-only triggers" in recover.stderr
    assert f"quiesce db upgrade --ledger {url}" in recover.stderr
    assert anyio.run(_count, url) == 6
    upgrade = run_cli("db", "upgrade", "--ledger", url, "--json")
    assert upgrade.returncode == 0, upgrade.stderr
    doc = json.loads(upgrade.stdout)
    assert doc["restored_triggers"] == list(APPEND_ONLY_TRIGGERS["sqlite"])
    assert doc["changed"] is True
    again = run_cli("db", "upgrade", "--ledger", url)
    assert again.returncode == 0
    assert "restored" not in again.stdout
    recover = run_cli("recover", "--config", str(config))
    assert recover.returncode == 0, recover.stderr
    assert anyio.run(_count, url) > 6  # the recovery was recorded
