"""High availability on PostgreSQL: two `quiesce serve` processes on one ledger.

The first holds the lease and serves; the second is a standby: every API request gets 503 naming
the active one's address, and `/readyz` is 503. A save through the client is held in prepare (a
hung resources prepare, the policy model paused) when the active service is SIGKILLed. The
standby takes the lease once it expires, recovers (every server the dead one paused is resumed),
then serves: no server is left paused, the client's retry — the same `RemoteCoordinator`, given
both addresses — is published by the standby, and the ledger shows the interrupted save rolled
back by the standby's epoch.

The issue's bound is checked on the ledger's own clock: the standby's `recovery.completed` is at
most `lease_s` + 1 s after the SIGKILL (one host, one clock; the figure is printed).
"""

from __future__ import annotations

import signal
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.ledger import Ledger
from quiesce.tools.gymsim.cluster import RunningCluster
from quiesce.tools.pgtemp import TempPostgres
from quiesce.tools.serve.client import RemoteCoordinator
from quiesce.tools.serve.errors import OutcomeUnknown
from tests.coordinator.helpers import (
    assert_all_accepting,
    clear_faults,
    read_events,
    server_states,
    set_faults,
)
from tests.serve.conftest import HOLD, Patience, ServiceProcess, wait_ready

pytestmark = [pytest.mark.anyio, pytest.mark.postgres, pytest.mark.timeout(240)]

LEASE_S = 2.0


async def test_standby_takes_over_after_sigkill_mid_save(
    cluster: RunningCluster, tmp_path: Path, postgres: TempPostgres, spawn_service: Any
) -> None:
    url = postgres.create_database(f"t_{uuid.uuid4().hex[:20]}")
    config = cluster.write_config(tmp_path / "cluster.yaml", url, tmp_path / "snaps", lease_s=LEASE_S)
    active: ServiceProcess = spawn_service(config)
    first = await wait_ready(active.url)
    standby: ServiceProcess = spawn_service(config)
    assert standby.announced["state"] == "standby"
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        while True:  # the standby reads the lease row to name the active one
            refused = await http.get(f"{standby.url}/v1/attempts")
            assert refused.status_code == 503
            if refused.json()["error"].get("active"):
                break
            await anyio.sleep(0.05)
        assert refused.json()["error"] == {
            "type": "Unavailable",
            "message": refused.json()["error"]["message"],
            "state": "standby",
            "active": active.url,
        }
        assert (await http.get(f"{standby.url}/readyz")).status_code == 503
        assert (await http.get(f"{standby.url}/healthz")).status_code == 200

        await set_faults(http, cluster.urls["tools"], [HOLD])
        client = RemoteCoordinator([active.url, standby.url], failover_s=60)
        lost: dict[str, BaseException] = {}

        async def save() -> None:
            try:
                await client.checkpoint(deadline_s=60)
            except OutcomeUnknown as error:
                lost["error"] = error

        async with anyio.create_task_group() as tg:
            tg.start_soon(save)
            patience = Patience()
            while (await server_states(http, cluster))["simple_agent"][0] != "prepared":
                await patience.wait('(await server_states(http, cluster))["simple_agent"][0] != "prepared"')
            killed_at = time.time()
            active.signal(signal.SIGKILL)
            await anyio.to_thread.run_sync(active.wait)
        assert "error" in lost  # the connection broke mid-save: the client cannot tell the outcome
        second = await wait_ready(standby.url)
        assert second["epoch"] == first["epoch"] + 1
        assert [(a["found"], a["action"]) for a in second["recovery"]["attempts"]] == [("prepare", "resumed")]
        await assert_all_accepting(http, cluster)  # the hold is still armed: recovery resumed everyone
        await clear_faults(http, cluster)
        retried = await client.checkpoint(deadline_s=60)  # the retry: fails over to the standby
        assert client.url == standby.url
        await client.aclose()
        await assert_all_accepting(http, cluster)
    events = await read_events(url)
    recovered = next(e for e in events if e.kind == "recovery.completed" and e.epoch == second["epoch"])
    took_s = datetime.fromisoformat(recovered.at).timestamp() - killed_at
    print(f"\nstandby recovered {took_s:.2f}s after SIGKILL (lease {LEASE_S:g}s)")
    assert took_s <= LEASE_S + 1.0
    async with Ledger.open(url, readonly=True) as ledger:
        rows = {r.checkpoint_id: r for r in await ledger.attempts()}
    [interrupted] = [r for r in rows.values() if r.epoch == first["epoch"]]
    assert (interrupted.outcome, interrupted.recovered_by) == ("aborted", second["epoch"])
    assert rows[retried.checkpoint_id].outcome == "published"
    assert retried.snapshot is not None
    assert (retried.snapshot / "manifest.json").is_file()
