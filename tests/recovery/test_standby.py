"""Standby takeover and fencing on PostgreSQL, with real coordinator processes.

An active coordinator (a child process) is stuck in prepare — a model request hangs, so the drain
never ends — when it is SIGKILLed (or SIGSTOPped). A standby coordinator (another process,
`Coordinator.open(config, standby=True)`) takes the lease once it has expired, ends the old
holder's writer session, takes the next epoch and recovers: every server is accepting again.
A SIGSTOPped zombie, continued after the takeover, appends nothing and sends nothing, and stops
at once (its call in flight not waited for).

No wall-clock limits are asserted: the order is (the standby's epoch starts after the old lease's
expiry, on one clock), and the measured takeover time is printed.
"""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.tools.gymsim import client
from quiesce.tools.pgtemp import TempPostgres
from tests.coordinator.helpers import assert_all_accepting, control_logs, read_events
from tests.recovery.standby_procs import (
    LEASE_S,
    assert_took_over,
    assert_zombie_silent,
    line,
    spawn,
    wait_for,
)

pytestmark = [pytest.mark.anyio, pytest.mark.postgres, pytest.mark.timeout(180)]

ROLLOUTS = {f"r{i}": 4 for i in range(3)}


async def _stuck_in_prepare(http: httpx.AsyncClient, cluster: Any, config: Path, token: str) -> Any:
    """Rollouts with a hung model request, and an active coordinator draining forever."""
    fault = {"kind": "hang", "path": "/v1/responses", "times": 1}
    faults = f"{cluster.urls['policy_model']}/gymsim/admin/faults"
    (await http.post(faults, json={"faults": [fault]})).raise_for_status()
    await client.start_rollouts(http, cluster.urls["simple_agent"], ROLLOUTS)
    active = spawn("active", config, token)
    opened = line(active)

    async def paused() -> bool:
        log = (await control_logs(http, cluster))["policy_model"]
        return any(entry["path"].endswith("/pause") for entry in log)

    await wait_for(paused)
    return active, opened


async def test_standby_takes_over_after_sigkill_mid_prepare(
    make_cluster: Any, postgres: TempPostgres, tmp_path: Path, token: str
) -> None:
    url = postgres.create_database(f"t_{uuid.uuid4().hex[:20]}")
    with make_cluster(None) as cluster:
        config = cluster.write_config(tmp_path / "cluster.yaml", url, tmp_path / "snaps", lease_s=LEASE_S)
        async with httpx.AsyncClient() as http:
            active, opened = await _stuck_in_prepare(http, cluster, config, token)
            standby = spawn("standby", config, token)
            await anyio.sleep(LEASE_S)  # the active one renews: the standby keeps waiting
            assert standby.poll() is None
            killed_at = time.time()
            active.send_signal(signal.SIGKILL)
            active.wait()
            took = line(standby)
            assert standby.wait(timeout=60) == 0
            await assert_all_accepting(http, cluster)
            await http.delete(f"{cluster.urls['policy_model']}/gymsim/admin/faults")
            rollouts = await client.wait_finished(http, cluster.urls["simple_agent"], timeout_s=60)
    assert client.turn_log_problems(rollouts) == []
    await assert_took_over(url, opened, took, killed_at, LEASE_S)


async def test_sigstopped_zombie_is_fenced_after_takeover(
    make_cluster: Any, postgres: TempPostgres, tmp_path: Path, token: str
) -> None:
    url = postgres.create_database(f"t_{uuid.uuid4().hex[:20]}")
    with make_cluster(None) as cluster:
        config = cluster.write_config(tmp_path / "cluster.yaml", url, tmp_path / "snaps", lease_s=LEASE_S)
        async with httpx.AsyncClient() as http:
            zombie, opened = await _stuck_in_prepare(http, cluster, config, token)
            zombie.send_signal(signal.SIGSTOP)
            try:
                standby = spawn("standby", config, token)
                took = line(standby)
                assert standby.wait(timeout=60) == 0
                await assert_all_accepting(http, cluster)
                logs_before = await control_logs(http, cluster)
                events_before = await read_events(url)
            finally:
                zombie.send_signal(signal.SIGCONT)
            woke = line(zombie)
            assert zombie.wait(timeout=60) == 3
            assert woke["event"] == "fenced"
            logs_after = await control_logs(http, cluster)
            await http.delete(f"{cluster.urls['policy_model']}/gymsim/admin/faults")
            rollouts = await client.wait_finished(http, cluster.urls["simple_agent"], timeout_s=60)
    assert client.turn_log_problems(rollouts) == []
    # woken, the zombie stopped at once — its lease renewal found the lease taken — and did not
    # wait for its prepare call to the draining agent: that call was still unanswered when the
    # zombie had exited (it ends only with the agent's own drain deadline)
    assert "taken over by another coordinator" in woke["error"]
    zombie_id = next(
        ev.checkpoint_id
        for ev in events_before
        if ev.kind == "attempt.started" and ev.epoch == opened["epoch"]
    )
    unanswered = [
        e["path"]
        for log in logs_after.values()
        for e in log
        if e["checkpoint_id"] == zombie_id and e["status"] is None
    ]
    assert any(path.endswith("/prepare") for path in unanswered), unanswered
    await assert_zombie_silent(url, opened, took, (logs_before, logs_after), events_before)
