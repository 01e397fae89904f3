"""Standby takeover and fencing on Gym's unified plane (v2), on PostgreSQL, with real coordinator
processes against real v2 reference servers (uvicorn, on loopback) whose episodes run.

An active coordinator (`tests/recovery/standby_child.py`, a child process) is stuck in prepare —
one episode is held mid-turn, so the environment's prepare waits for it until the deadline — when
it is SIGKILLed (or SIGSTOPped). A standby coordinator (another process,
`Coordinator.open(config, standby=True)`) takes the lease once it has expired, takes the next
epoch and rolls the attempt back from the ledger: every server is idle again without any v2 lease
having expired (the servers' lease grace is 600 s), and the episodes finish exactly as an
uninterrupted run once released. A SIGSTOPped zombie, continued after the takeover, is fenced:
it appends nothing and sends nothing more.

No wall-clock limits are asserted: the order is (the standby's epoch starts after the old lease's
expiry, on one clock).
"""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator.protocol_v2 import PREFIX
from quiesce.tools.gymsim.cluster import RunningCluster, start_cluster
from quiesce.tools.gymsim.spec import default_v2_spec
from quiesce.tools.gymsim.v2.trainer import Trainer, expected_results, make_tasks
from quiesce.tools.pgtemp import TempPostgres
from tests.coordinator.helpers import control_logs, read_events
from tests.recovery.standby_procs import (
    LEASE_S,
    assert_took_over,
    assert_zombie_silent,
    line,
    spawn,
    wait_for,
)

pytestmark = [pytest.mark.anyio, pytest.mark.postgres, pytest.mark.timeout(180)]

TASKS = make_tasks(3, turns=3)


async def _phases(http: httpx.AsyncClient, running: RunningCluster, token: str) -> dict[str, str]:
    auth = {"authorization": f"Bearer {token}"}
    return {
        name: (await http.get(f"{url}{PREFIX}/status", headers=auth)).json()["phase"]
        for name, url in running.urls.items()
    }


async def _lease_expirations(http: httpx.AsyncClient, running: RunningCluster) -> dict[str, int]:
    return {
        name: (await http.get(f"{url}/gymsim/admin/state")).json()["lease_expirations"]
        for name, url in running.urls.items()
    }


@dataclass
class _Stuck:
    """A v2 cluster whose active coordinator (`active`, a child process) is stuck in prepare."""

    url: str
    running: RunningCluster
    http: httpx.AsyncClient
    config: Path
    active: subprocess.Popen[str]
    opened: dict[str, Any]
    trainer: Trainer


@asynccontextmanager
async def _stuck_in_prepare(postgres: TempPostgres, tmp_path: Path, token: str) -> AsyncIterator[_Stuck]:
    """A v2 cluster on a PostgreSQL ledger (lease `LEASE_S`), episodes with one held mid-turn, and
    an active coordinator whose environment prepare waits for it; the active one is killed at the end."""
    url = postgres.create_database(f"t_{uuid.uuid4().hex[:20]}")
    with start_cluster(default_v2_spec(), token=token) as running:
        config = running.write_config(tmp_path / "cluster.yaml", url, tmp_path / "snaps", lease_s=LEASE_S)
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            trainer = Trainer(running.urls["environment"], http=http)
            await trainer.start(TASKS, paced=True)
            await trainer.wait_parked()
            await trainer.hold_mid_turn(["r1"])
            active = spawn("active", config, token)
            try:
                opened = line(active)

                async def preparing() -> bool:
                    log = (await control_logs(http, running))["environment"]
                    return any(e["path"].endswith("/prepare") and e["status"] is None for e in log)

                await wait_for(preparing)
                yield _Stuck(url, running, http, config, active, opened, trainer)
            finally:
                if active.poll() is None:
                    active.send_signal(signal.SIGCONT)
                    active.kill()
                active.wait()


async def _finish(trainer: Trainer) -> dict[str, str]:
    await trainer.release()
    await trainer.unpace()
    return await trainer.wait_results()


async def test_standby_takes_over_a_v2_save_after_sigkill_mid_prepare(
    postgres: TempPostgres, tmp_path: Path, token: str
) -> None:
    async with _stuck_in_prepare(postgres, tmp_path, token) as stuck:
        http, running = stuck.http, stuck.running
        assert (await _phases(http, running, token))["environment"] == "preparing"
        standby = spawn("standby", stuck.config, token)
        killed_at = time.time()
        stuck.active.send_signal(signal.SIGKILL)
        stuck.active.wait()
        took = line(standby)
        assert standby.wait(timeout=60) == 0
        after = await _phases(http, running, token)
        expirations = await _lease_expirations(http, running)
        results = await _finish(stuck.trainer)
    assert after == dict.fromkeys(running.urls, "idle")
    assert expirations == dict.fromkeys(running.urls, 0)  # rolled back from the ledger, not by leases
    assert results == expected_results(TASKS)
    await assert_took_over(stuck.url, stuck.opened, took, killed_at, LEASE_S)


async def test_a_sigstopped_v2_zombie_is_fenced_after_takeover(
    postgres: TempPostgres, tmp_path: Path, token: str
) -> None:
    async with _stuck_in_prepare(postgres, tmp_path, token) as stuck:
        http, running, zombie = stuck.http, stuck.running, stuck.active
        zombie.send_signal(signal.SIGSTOP)
        try:
            standby = spawn("standby", stuck.config, token)
            took = line(standby)
            assert standby.wait(timeout=60) == 0
            after_takeover = await _phases(http, running, token)
            logs_before = await control_logs(http, running)
            events_before = await read_events(stuck.url)
        finally:
            zombie.send_signal(signal.SIGCONT)
        woke = line(zombie)
        assert zombie.wait(timeout=60) == 3
        logs_after = await control_logs(http, running)
        after_wake = await _phases(http, running, token)
        results = await _finish(stuck.trainer)
    assert woke["event"] == "fenced"
    assert after_takeover == after_wake == dict.fromkeys(running.urls, "idle")
    assert results == expected_results(TASKS)
    await assert_zombie_silent(stuck.url, stuck.opened, took, (logs_before, logs_after), events_before)
