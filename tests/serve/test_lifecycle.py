"""What happens to an attempt when its client goes away or the service is told to stop.

Each save is held in prepare by a hung resources prepare (the policy model paused, the agent
prepared), so the event — a disconnect, a SIGTERM — lands in the middle of it, at a known point:

- a client that disconnects mid-save does not cancel it: once the hold is released the save runs
  to its end and is published; every server accepts again;
- SIGTERM mid-save: the service takes no new request (503), the save in progress ends within its
  deadline — rolled back, as the hold outlives it — the waiting client gets that outcome (502,
  the rollback named), every server accepts again, and the service exits 0;
- SIGTERM while a two-step save awaits its caller: rolled back, exit 0, no server paused;
- a two-step save nobody continues is rolled back once its deadline has passed.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.ledger import Ledger
from quiesce.tools.gymsim.cluster import RunningCluster
from tests.coordinator.helpers import assert_all_accepting, clear_faults, server_states, set_faults
from tests.serve.conftest import HOLD, Patience, ServiceProcess, wait_ready

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


def _config(cluster: RunningCluster, tmp_path: Path, ledger_url: str) -> Path:
    return cluster.write_config(tmp_path / "cluster.yaml", ledger_url, tmp_path / "snaps")


async def _held(http: httpx.AsyncClient, cluster: RunningCluster) -> None:
    """Wait until the save in progress sits in the held resources prepare."""
    patience = Patience()
    while (await server_states(http, cluster))["simple_agent"][0] != "prepared":
        await patience.wait('(await server_states(http, cluster))["simple_agent"][0] != "prepared"')


async def _outcomes(ledger_url: str) -> list[tuple[str, str | None]]:
    async with Ledger.open(ledger_url, readonly=True) as ledger:
        return [(r.checkpoint_id, r.outcome) for r in await ledger.attempts()]


async def test_a_disconnected_client_does_not_cancel_its_save(
    cluster: RunningCluster, tmp_path: Path, ledger_url: str, spawn_service: Any
) -> None:
    service: ServiceProcess = spawn_service(_config(cluster, tmp_path, ledger_url))
    await wait_ready(service.url)
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        await set_faults(http, cluster.urls["tools"], [HOLD])
        async with anyio.create_task_group() as tg:

            async def save_then_vanish() -> None:
                async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=120) as gone:
                    await gone.post("/v1/checkpoints", json={"deadline_s": 60})

            tg.start_soon(save_then_vanish)
            await _held(http, cluster)
            tg.cancel_scope.cancel()  # the client closes its connection mid-save
        [(cid, outcome)] = await _outcomes(ledger_url)
        assert outcome is None  # still running
        await clear_faults(http, cluster)
        patience = Patience()
        while (await _outcomes(ledger_url))[0][1] is None:
            await patience.wait("(await _outcomes(ledger_url))[0][1] is None")
        assert await _outcomes(ledger_url) == [(cid, "published")]
        await assert_all_accepting(http, cluster)
        assert (tmp_path / "snaps" / cid / "manifest.json").is_file()
        ready = (await http.get(f"{service.url}/readyz")).json()
        assert ready["busy"] is None


async def test_sigterm_mid_save_rolls_back_within_its_deadline_and_exits(
    cluster: RunningCluster, tmp_path: Path, ledger_url: str, spawn_service: Any
) -> None:
    service: ServiceProcess = spawn_service(_config(cluster, tmp_path, ledger_url))
    await wait_ready(service.url)
    async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
        await set_faults(http, cluster.urls["tools"], [HOLD])
        result: dict[str, Any] = {}

        async def save() -> None:
            result["reply"] = await http.post(f"{service.url}/v1/checkpoints", json={"deadline_s": 4})

        async with anyio.create_task_group() as tg:
            tg.start_soon(save)
            await _held(http, cluster)
            service.signal(signal.SIGTERM)
            patience = Patience()
            while (await http.get(f"{service.url}/healthz")).json()["state"] != "stopping":
                await patience.wait(
                    '(await http.get(f"{service.url}/healthz")).json()["state"] != "stopping"'
                )
            refused = await http.post(f"{service.url}/v1/checkpoints", json={})
            assert refused.status_code == 503
            assert refused.json()["error"]["state"] == "stopping"
        reply = result["reply"]
        assert reply.status_code == 502, reply.text
        error = reply.json()["error"]
        assert error["type"] == "DeadlineExceeded"
        assert set(error["resumed"]) == {"policy_model", "simple_agent", "tools"}
        assert error["not_resumed"] == []
        assert await anyio.to_thread.run_sync(service.wait) == 0
        await clear_faults(http, cluster)
        await assert_all_accepting(http, cluster)
    [(_, outcome)] = await _outcomes(ledger_url)
    assert outcome == "aborted"


async def test_sigterm_rolls_back_a_two_step_save_awaiting_its_caller(
    cluster: RunningCluster, tmp_path: Path, ledger_url: str, spawn_service: Any
) -> None:
    service: ServiceProcess = spawn_service(_config(cluster, tmp_path, ledger_url))
    await wait_ready(service.url)
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        started = (await http.post(f"{service.url}/v1/attempts", json={"deadline_s": 120})).json()
        assert (await server_states(http, cluster))["policy_model"][0] == "committed_paused"
        service.signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(service.wait) == 0
        await assert_all_accepting(http, cluster)
    assert await _outcomes(ledger_url) == [(started["checkpoint_id"], "aborted")]
    assert not (tmp_path / "snaps" / ".staging" / started["checkpoint_id"]).exists()


async def test_a_two_step_save_nobody_continues_is_rolled_back_after_its_deadline(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, spawn_service: Any
) -> None:
    service: ServiceProcess = spawn_service(_config(cluster, tmp_path, sqlite_url))
    await wait_ready(service.url)
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        started = (await http.post(f"{service.url}/v1/attempts", json={"deadline_s": 1})).json()
        patience = Patience()
        while (await _outcomes(sqlite_url))[0][1] is None:
            await patience.wait("(await _outcomes(sqlite_url))[0][1] is None")
        assert await _outcomes(sqlite_url) == [(started["checkpoint_id"], "aborted")]
        await assert_all_accepting(http, cluster)
        late = await http.post(f"{service.url}/v1/attempts/{started['checkpoint_id']}/publish", json={})
        assert late.status_code == 404
        shown = (await http.get(f"{service.url}/v1/attempts/{started['checkpoint_id']}")).json()
        assert "deadline" in shown["abort_reason"]
        again = await http.post(f"{service.url}/v1/checkpoints", json={})
        assert again.status_code == 200, again.text
