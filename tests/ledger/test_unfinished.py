"""``Ledger.unfinished_attempts``: the attempts without a terminal event, filtered by the database."""

from __future__ import annotations

import pytest

from ledger import AppendItem, Ledger
from tests.ledger.helpers import COORDINATOR, started

pytestmark = pytest.mark.anyio


async def test_unfinished_attempts_are_exactly_those_without_an_outcome(ledger_url: str) -> None:
    async with Ledger.open(ledger_url, durability="process") as ledger:
        await ledger.start_epoch(COORDINATOR)
        items: list[AppendItem] = []
        for i in range(300):
            cid = f"c{i:04d}"
            items.append(AppendItem("attempt.started", checkpoint_id=cid, data=started()))
            if i % 100 != 37:  # three left open: c0037, c0137, c0237
                outcome = "published" if i % 2 else "aborted"
                if outcome == "published":
                    items.append(AppendItem("attempt.completed", checkpoint_id=cid,
                                            data={"servers": ["agent"], "outcome": "published"}))  # fmt: skip
                else:
                    items.append(AppendItem("attempt.aborted", checkpoint_id=cid, data={"reason": "test"}))
        await ledger.append_many(items)
        # an older open attempt touched again later sorts by its last seq, not by its id
        await ledger.append("phase.started", checkpoint_id="c0037", data={"phase": "prepare"})
        unfinished = await ledger.unfinished_attempts()
        everything = await ledger.attempts()
    assert [row.checkpoint_id for row in unfinished] == ["c0137", "c0237", "c0037"]
    expected = sorted((row for row in everything if row.outcome is None), key=lambda row: row.last_seq)
    assert unfinished == expected
    assert len(everything) == 300


async def test_unfinished_attempts_of_an_empty_ledger(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        assert await ledger.unfinished_attempts() == []
