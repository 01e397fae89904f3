"""Recovery reads the unfinished attempts only: its cost follows them, not the ledger's history.

A ledger with finished attempts behind the one a dead coordinator left: recovery at open must
finish that one attempt without reading the whole ``attempts`` projection (``Ledger.attempts``
is made to fail for the test) and without reading events beyond the unfinished attempt's own
(``Ledger.read`` fails for the test unless it names a checkpoint id), so the work it does per
open does not grow with the history.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from quiesce.coordinator import Coordinator
from quiesce.ledger import Ledger
from quiesce.tools.gymsim import client
from tests.coordinator.helpers import assert_all_accepting
from tests.recovery.helpers import Died, kind_is

pytestmark = pytest.mark.anyio


async def test_recovery_never_reads_the_whole_attempts_projection(
    cluster: Any, sqlite_url: str, configure: Any, die_after: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = configure(cluster, sqlite_url)
    async with Coordinator.open(config) as coord:
        for _ in range(3):
            await coord.checkpoint(deadline_s=30)
    die_after(kind_is("phase.completed", phase="prepare"))
    async with httpx.AsyncClient() as http:
        # long enough to be mid-rollout at the prepare: a finished one is held until acknowledged
        for name in ("policy_model", "tools"):
            await http.post(f"{cluster.urls[name]}/gymsim/admin/options", json={"latency_s": 0.01})
        await client.start_rollouts(http, cluster.urls["simple_agent"], {"r0": 60})
        await client.wait_turns(http, cluster.urls["simple_agent"], 1)
        with pytest.raises(Died):
            async with Coordinator.open(config) as coord:
                await coord.checkpoint(deadline_s=30)
        async with Ledger.open(sqlite_url, readonly=True) as ledger:
            history = await ledger.attempts()
        unfinished = [row.checkpoint_id for row in history if row.outcome is None]
        assert len(history) == 4
        assert len(unfinished) == 1

        async def whole_projection(*args: object, **kwargs: object) -> None:
            raise AssertionError("recovery read every attempt of the history")

        monkeypatch.setattr(Ledger, "attempts", whole_projection)
        reads = Ledger.read

        def one_attempt_only(self: Ledger, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("checkpoint_id") is None:
                raise AssertionError(f"recovery read the ledger beyond one attempt: {args} {kwargs}")
            return reads(self, *args, **kwargs)

        monkeypatch.setattr(Ledger, "read", one_attempt_only)
        async with Coordinator.open(config) as coord:
            report = coord.last_recovery
        assert report is not None
        assert [(a.checkpoint_id, a.action) for a in report.attempts] == [(unfinished[0], "resumed")]
        await assert_all_accepting(http, cluster)
        rollouts = await client.wait_finished(http, cluster.urls["simple_agent"], timeout_s=60)
        assert all(r["status"] == "completed" for r in rollouts.values())
