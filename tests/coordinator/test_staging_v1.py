"""v1: the staging folder is made beside the prepare phase (`coordinator/staging.py`), against the
real v1 reference cluster and a real SQLite ledger: there, durable, when the prepare returns and
before any commit request; removed by a rollback. (v2, a save in place, and a staging path that
cannot be used: `tests/coordinator_v2/test_staging.py`.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from quiesce.coordinator import ClusterConfig, Coordinator
from quiesce.tools.gymsim.cluster import RunningCluster
from tests.coordinator.helpers import assert_all_accepting, assert_staging_made, read_events

pytestmark = pytest.mark.anyio


async def test_the_staging_folder_is_there_when_the_prepare_returns_and_a_rollback_removes_it(
    cluster: RunningCluster, sqlite_url: str, configure: Callable[..., ClusterConfig]
) -> None:
    async with (
        httpx.AsyncClient(timeout=30) as http,
        Coordinator.open(configure(cluster, sqlite_url)) as coord,
    ):
        attempt = await coord.prepare(deadline_s=20)
        staging = assert_staging_made(attempt)
        recorded: list[Any] = await read_events(sqlite_url, attempt.checkpoint_id)
        paths = [ev.data["path"] for ev in recorded if ev.kind == "call.sent"]
        assert paths
        assert not any(p.endswith("/commit") for p in paths)  # made before any commit request
        await coord.abort(attempt)
        assert not staging.exists()
        await assert_all_accepting(http, cluster)
