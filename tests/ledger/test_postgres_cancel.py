"""A PostgreSQL ledger's reads cancelled while its pool opens connections (a deadline reaching
a read midway): nothing is logged as a never-retrieved error, and no session is left open."""

from __future__ import annotations

import asyncio
import gc
import uuid
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from quiesce.ledger import Ledger
from quiesce.tools.pgtemp import TempPostgres
from tests.ledger.helpers import raw_sql

pytestmark = pytest.mark.anyio

_SESSIONS = "SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}' AND backend_type = 'client backend'"


async def test_reads_cancelled_while_connecting_leave_no_error_and_no_session(
    postgres: TempPostgres,
) -> None:
    db = f"t_{uuid.uuid4().hex[:20]}"
    url = postgres.create_database(db)
    loop = asyncio.get_running_loop()
    logged: list[str] = []
    handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: logged.append(str(context.get("exception") or context)))
    cancelled = 0
    try:
        async with Ledger.open(url) as ledger:
            for i in range(80):
                # twelve reads at once: the pool (4 + 8 overflow) opens connections for them,
                # and the deadline falls at a different point of those connects each round
                with anyio.move_on_after((i % 20) * 0.0005) as scope:
                    async with anyio.create_task_group() as tg:
                        for _ in range(12):
                            tg.start_soon(ledger.head)
                cancelled += scope.cancelled_caught
            await anyio.sleep(0.5)  # connects that went on alone end
            gc.collect()  # a failed future nobody retrieved is reported when it is collected
            await anyio.lowlevel.checkpoint()  # the loop reports what the collection found
        assert cancelled >= 20  # the deadline did fall inside the reads
        assert logged == []
        left: list[Any] = []
        with anyio.fail_after(10):
            while True:
                left = await raw_sql(postgres.url(), _SESSIONS.format(db=db))
                if left == [(0,)]:
                    break
                await anyio.sleep(0.1)
        assert left == [(0,)]
    finally:
        loop.set_exception_handler(handler)
