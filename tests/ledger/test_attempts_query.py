"""`Ledger.attempts`: outcome filters (exact, several, open), keyset pages and `limit` — the newest
N read from the end of the start-order index (revision 0005), on both backends; and `history
--limit` through the real CLI gives what slicing the whole history gave."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quiesce.ledger import Ledger
from tests.ledger.helpers import COORDINATOR, REPO, is_sqlite, raw_sql, sqlite_path, started

pytestmark = pytest.mark.anyio

#: (id, kind, outcome): oldest first; None: still open
PLAN = [
    (f"c{n:03d}", "restore" if n % 5 == 0 else "save", [None, "published", "aborted", "restored"][n % 4])
    for n in range(40)
]


async def _fill(url: str) -> None:
    async with Ledger.open(url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        for cid, kind, outcome in PLAN:
            await ledger.append("attempt.started", checkpoint_id=cid, data=started(kind))
            if outcome == "aborted":
                await ledger.append("attempt.aborted", checkpoint_id=cid, data={"reason": "x"})
            elif outcome is not None:
                await ledger.append(
                    "attempt.completed", checkpoint_id=cid, data={"servers": ["p"], "outcome": outcome}
                )


async def test_limits_outcomes_and_pages_select_what_slicing_selected(ledger_url: str) -> None:
    await _fill(ledger_url)
    async with Ledger.open(ledger_url, readonly=True) as ledger:
        every = await ledger.attempts()
        ids = [r.checkpoint_id for r in every]
        assert ids == [cid for cid, _, _ in PLAN]
        for limit in (1, 7, 40, 100):
            assert [r.checkpoint_id for r in await ledger.attempts(limit=limit)] == ids[-limit:]
        published = [cid for cid, _, o in PLAN if o == "published"]
        assert [r.checkpoint_id for r in await ledger.attempts(outcome="published", limit=3)] == published[
            -3:
        ]
        open_ = [cid for cid, _, o in PLAN if o is None]
        assert [r.checkpoint_id for r in await ledger.attempts(outcome="open")] == open_
        both = [cid for cid, _, o in PLAN if o in ("published", "aborted")]
        assert [r.checkpoint_id for r in await ledger.attempts(outcome=("published", "aborted"))] == both
        # keyset pages back from the newest, 9 at a time, rebuild the whole history
        pages: list[str] = []
        before: tuple[str, str] | None = None
        while True:
            page = await ledger.attempts(limit=9, before=before)
            pages = [r.checkpoint_id for r in page] + pages
            if len(page) < 9:
                break
            before = (page[0].started_at, page[0].checkpoint_id)
        assert pages == ids
        since = every[30].started_at
        assert [r.checkpoint_id for r in await ledger.attempts(since=since, limit=4)] == ids[-4:]
        with pytest.raises(ValueError, match="limit"):
            await ledger.attempts(limit=-1)


async def test_the_newest_n_come_from_the_start_order_index(ledger_url: str) -> None:
    """The plan of `limit`'s query walks ix_attempts_started (no sort of every attempt)."""
    await _fill(ledger_url)
    sql = (
        "SELECT checkpoint_id FROM attempts WHERE 1 = 1 AND outcome = 'published'"
        " ORDER BY started_at DESC, checkpoint_id DESC LIMIT 3"
    )
    if is_sqlite(ledger_url):
        plan = " ".join(str(row) for row in await raw_sql(ledger_url, f"EXPLAIN QUERY PLAN {sql}"))
        assert "ix_attempts_started" in plan, plan
        assert "TEMP B-TREE" not in plan, plan
    else:
        rows = await raw_sql(ledger_url, "SET enable_seqscan = off", f"EXPLAIN {sql}")
        plan = " ".join(str(row) for row in rows)
        assert "ix_attempts_started" in plan, plan
        assert "Sort" not in plan, plan


def test_history_limit_through_the_cli_is_the_newest_n(tmp_path: Path) -> None:
    import anyio

    url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_fill, url)
    done = subprocess.run(
        [sys.executable, "-m", "quiesce.tools.cli.main", "history", "--ledger", sqlite_path(url),
         "--limit", "5", "-o", "json"],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = [row["checkpoint_id"] for row in json.loads(done.stdout)]
    assert shown == [cid for cid, _, _ in PLAN][-5:]
