"""The ledger queries recovery makes, answered by the database whatever the history's length:
``Ledger.unfinished_attempts`` (the attempts without a terminal event) and ``Ledger.last_before``
(the last event of a kind before a seq)."""

from __future__ import annotations

import pytest

from quiesce.ledger import AppendItem, Ledger
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


async def test_last_before_finds_the_last_event_of_a_kind_before_a_seq(ledger_url: str) -> None:
    async with Ledger.open(ledger_url, durability="process") as ledger:
        await ledger.start_epoch(COORDINATOR)
        seqs: list[int] = []
        for i in range(5):
            member = {
                "name": f"s{i}",
                "component": "responses_api_agents",
                "mode": "export_restore",
                "url": "u",
            }
            found = {"participants": [member], "skipped": [], "refused": []}
            seqs.append((await ledger.append("discovery.completed", data=found)).seq)
            await ledger.append("attempt.started", checkpoint_id=f"c{i}", data=started())
        assert await ledger.last_before("discovery.completed", seqs[0]) is None
        for i, seq in enumerate(seqs):
            last = await ledger.last_before("discovery.completed", seq + 1)
            assert last is not None
            assert (last.seq, last.data["participants"][0]["name"]) == (seq, f"s{i}")
        head = await ledger.head()
        assert head is not None
        last = await ledger.last_before("discovery.completed", head.seq + 100)
        assert last is not None
        assert last.seq == seqs[-1]
        assert await ledger.last_before("recovery.completed", head.seq + 1) is None
