"""An append writes only the projection columns it changes, so it rewrites no index entry it leaves alone.

SQLite rewrites an index's entry whenever an ``UPDATE`` names one of the index's columns, even when
the value stays the same. A recorded call changes ``calls`` and ``last_seq`` of its attempt's row;
were every column set, each ``call.sent`` commit would also write a page of ``ix_attempts_started``
(5 WAL frames instead of 4). The rows stored must still be exactly what replay rebuilds.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from quiesce.ledger import Ledger, replay_url
from quiesce.ledger.projections import COLUMNS
from quiesce.ledger.sqlite import update_sql
from quiesce.tools.bench.ledger import wal_frames
from tests.ledger.helpers import COORDINATOR, FAILED, REPLIED, SENT, started

pytestmark = pytest.mark.anyio


def test_the_update_names_only_the_changed_columns() -> None:
    calls, last = COLUMNS.index("calls"), COLUMNS.index("last_seq")
    assert update_sql((calls, last)) == "UPDATE attempts SET calls = ?, last_seq = ? WHERE checkpoint_id = ?"


async def test_a_recorded_call_writes_no_page_of_an_index_it_leaves_alone(tmp_path: Path) -> None:
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
        await ledger.append("call.sent", checkpoint_id="c1", server="agent", call_id="c1/x", data=SENT)
        await ledger.append("call.failed", checkpoint_id="c1", server="agent", call_id="c1/x", data=FAILED)
        await ledger.append("phase.started", checkpoint_id="c1", data={"phase": "commit"})
        row = await ledger.attempt("c1")
    # call.sent: the events page, its checkpoint index page, the attempt's row, its last_seq entry
    assert statistics.median(frames["call.sent"]) == 4
    # call.replied changes no projection row: the events page and its checkpoint index page
    assert statistics.median(frames["call.replied"]) == 2
    assert row is not None
    assert (row.calls, row.failures, row.state) == (22, 1, "commit")
    report = await replay_url(url)
    assert report.ok, report.problem
