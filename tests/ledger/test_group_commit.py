"""Group commit: concurrent appends share transactions, yet each returns only once durable, in order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from ledger import Event, Ledger, replay_url
from tests.ledger.helpers import COORDINATOR, REPLIED, SENT

pytestmark = pytest.mark.anyio


async def test_concurrent_appends_are_batched_in_order_and_each_durable(ledger_url: str) -> None:
    seen: list[list[int]] = []

    def record(events: Sequence[Event]) -> None:
        seen.append([e.seq for e in events])

    results: dict[int, list[Event]] = {}
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        ledger.after_append = record
        backend = ledger.backend
        transactions: list[int] = []
        real_append = backend.append

        async def counting_append(batch: Any) -> None:
            transactions.append(len(batch.rows))
            await real_append(batch)

        backend.append = counting_append  # type: ignore[method-assign]

        async def call(i: int) -> None:
            sent = await ledger.append(
                "call.sent", checkpoint_id="c1", server=f"s{i}", call_id=f"k{i}", data=SENT
            )
            await anyio.sleep(0.001 * (i % 7))
            replied = await ledger.append(
                "call.replied", checkpoint_id="c1", server=f"s{i}", call_id=f"k{i}", data=REPLIED
            )
            results[i] = [sent, replied]

        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(call, i)
        stored = [e async for e in ledger.read()]
    assert len(stored) == 401
    assert sum(transactions) == 400
    assert len(transactions) < 300, "concurrent appends should share transactions"
    assert [e.seq for e in stored] == list(range(1, 402))
    for i, (sent, replied) in results.items():
        assert sent.seq < replied.seq
        assert stored[sent.seq - 1] == sent
        assert stored[replied.seq - 1] == replied
        assert (sent.call_id, replied.call_id) == (f"k{i}", f"k{i}")
    # after_append: once per append, with exactly its own events, in seq order
    assert len(seen) == 400
    assert [seq for group in seen for seq in group] == list(range(2, 402))
    assert (await replay_url(ledger_url)).ok


async def test_a_cancelled_append_still_commits_and_others_are_unaffected(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)

        async def one(i: int) -> None:
            await ledger.append("call.sent", checkpoint_id="c1", server="s", call_id=f"k{i}", data=SENT)

        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                for i in range(10):
                    tg.start_soon(one, i)
                scope.cancel()
        after = await ledger.append("call.sent", checkpoint_id="c1", server="s", call_id="last", data=SENT)
        stored = [e async for e in ledger.read()]
    assert stored[-1] == after
    assert [e.seq for e in stored] == list(range(1, len(stored) + 1))
    assert (await replay_url(ledger_url)).ok
