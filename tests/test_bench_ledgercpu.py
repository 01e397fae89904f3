"""`tools/bench/ledgercpu.py`: the ledger's own CPU, counted where it runs (measure #12's save cost).

On a real SQLite ledger: the CPU of its appends is counted, on the event loop and on the worker
thread a commit or fsync runs on; CPU that other tasks use while a ledger call is suspended, and
work other code hands to a worker thread, is not; errors still reach the caller.
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from quiesce.ledger import Ledger, LedgerError
from quiesce.tools.bench.ledgercpu import LedgerCpu
from tests.ledger.helpers import COORDINATOR, REPLIED, SENT, started

pytestmark = pytest.mark.anyio


def _burn(seconds: float) -> None:
    """Use about ``seconds`` of this thread's CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def test_the_ledgers_cpu_is_counted_and_no_one_elses(tmp_path: Path) -> None:
    async with Ledger.open(f"sqlite+aiosqlite:///{tmp_path / 'l.db'}") as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        original = anyio.to_thread.run_sync
        with LedgerCpu(ledger) as meter:
            assert anyio.to_thread.run_sync is not original
            start = time.thread_time()
            for i in range(200):
                await ledger.append("call.sent", checkpoint_id="c1", server="s", call_id=f"c1/{i}", data=SENT)
                await ledger.append(
                    "call.replied", checkpoint_id="c1", server="s", call_id=f"c1/{i}", data=REPLIED
                )
            used = time.thread_time() - start
            appends = meter.total
            # 400 appends on this thread: counted, and not more than this thread used meanwhile
            assert 0 < appends <= used

            # a ledger call suspended while another task burns CPU: the burn is not the ledger's
            async def sync_many() -> None:
                for i in range(20):
                    call = {"checkpoint_id": "c1", "server": "s", "call_id": f"d/{i}"}
                    await ledger.append("call.sent", data=SENT, durable=False, **call)
                    await ledger.sync()  # the fsync runs on a worker thread; this task waits

            before = meter.total
            async with anyio.create_task_group() as tg:
                tg.start_soon(sync_many)
                for _ in range(40):
                    _burn(0.005)
                    await anyio.lowlevel.checkpoint()
            assert 0 < meter.total - before < 0.1  # 200 ms were burnt beside it

            # work handed to a thread by someone else is not counted
            before = meter.total
            await anyio.to_thread.run_sync(_burn, 0.05)
            assert meter.total == before

            with pytest.raises(LedgerError, match="unknown event kind"):
                await ledger.append("no.such.kind", data={})
        assert anyio.to_thread.run_sync is original  # the process's hook is put back
