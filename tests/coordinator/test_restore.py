"""Restore: a snapshot taken mid-rollout, restored into a fresh cluster, finishes like an uninterrupted run.

Also: the snapshot is verified before any server is contacted (participant mismatch, altered
file → `SnapshotError` listing every difference, only capabilities requests sent).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator import Coordinator, SnapshotError, load_snapshot
from coordinator.protocol import CAPABILITIES_PATH
from ledger import Ledger
from tests.coordinator.helpers import (
    assert_all_accepting,
    assert_protocol_ok,
    control_logs,
    read_events,
    server_states,
)
from tools.gymsim import client

pytestmark = pytest.mark.anyio

ROLLOUTS = {f"r{i}": 8 for i in range(4)}


async def _uninterrupted(make_cluster: Any) -> dict[str, Any]:
    with make_cluster(None) as running:
        async with httpx.AsyncClient() as http:
            await client.start_rollouts(http, running.urls["simple_agent"], ROLLOUTS)
            rollouts = await client.wait_finished(http, running.urls["simple_agent"], timeout_s=60)
    return client.final_results(rollouts)


async def _checkpoint_mid_rollout(running: Any, config: Any) -> Path:
    agent = running.urls["simple_agent"]
    async with httpx.AsyncClient() as http:
        for name in ("policy_model", "tools"):
            await http.post(f"{running.urls[name]}/gymsim/admin/options", json={"latency_s": 0.1})
        await client.start_rollouts(http, agent, ROLLOUTS)
        await client.wait_turns(http, agent, 2)
        async with Coordinator.open(config) as coord:
            attempt = await coord.checkpoint(deadline_s=30)
        rollouts = await client.get_rollouts(http, agent)
        assert any(r["status"] != "completed" for r in rollouts.values()), "checkpoint was not mid-rollout"
    assert attempt.snapshot is not None
    return attempt.snapshot


async def test_restore_into_fresh_cluster(make_cluster: Any, ledger_url: str, configure: Any) -> None:
    expected = await _uninterrupted(make_cluster)
    with make_cluster(None) as first:
        snapshot = await _checkpoint_mid_rollout(first, configure(first, ledger_url))
    with make_cluster(None) as second:
        config = configure(second, ledger_url)
        async with httpx.AsyncClient() as http:
            async with Coordinator.open(config) as coord:
                await coord.discover()
                attempt = await coord.restore(snapshot)
                assert attempt.kind == "restore"
                assert attempt.source_checkpoint_id == snapshot.name
                assert attempt.touched == ["policy_model", "simple_agent", "tools"]
                states = await server_states(http, second)
                assert states["policy_model"][0] == "restored_paused"
                assert states["simple_agent"][0] == "restored_paused"
                assert states["tools"][0] == "restored_paused"
                assert states["judge"] == ("idle", "accepting")
                outcome = await coord.resume()
                assert outcome.outcome == "resumed"
                assert outcome.servers == ("tools", "policy_model", "simple_agent")
            await assert_all_accepting(http, second)
            rollouts = await client.wait_finished(http, second.urls["simple_agent"], timeout_s=60)
    assert client.final_results(rollouts) == expected
    assert client.turn_log_problems(rollouts) == []
    async with Ledger.open(ledger_url, readonly=True) as ledger:
        row = await ledger.attempt(attempt.checkpoint_id)
    assert row is not None
    assert (row.kind, row.outcome) == ("restore", "restored")
    completed = [
        ev.data["outcome"]
        for ev in await read_events(ledger_url, attempt.checkpoint_id)
        if ev.kind == "attempt.completed"
    ]
    assert completed == ["restored", "resumed"]
    await assert_protocol_ok(ledger_url)


async def test_restore_refused_before_any_call(make_cluster: Any, sqlite_url: str, configure: Any) -> None:
    with make_cluster(None) as first:
        snapshot = await _checkpoint_mid_rollout(first, configure(first, sqlite_url))
    other = {
        "servers": [
            {"kind": "model", "name": "policy_model"},
            {"kind": "agent", "name": "simple_agent", "policy": "policy_model", "resources": "tools"},
            {"kind": "agent", "name": "second_agent", "policy": "policy_model"},
            {"kind": "resources", "name": "tools"},
        ]
    }
    with make_cluster(other) as second:
        config = configure(second, sqlite_url)
        async with Coordinator.open(config) as coord:
            await coord.discover()
            with pytest.raises(SnapshotError) as caught:
                await coord.restore(snapshot)
            assert caught.value.differences == [
                "participant second_agent: a participant of this cluster but not in the snapshot"
            ]
            assert "second_agent" in str(caught.value)
        async with httpx.AsyncClient() as http:
            logs = await control_logs(http, second)
        assert all(entry["path"] == CAPABILITIES_PATH for log in logs.values() for entry in log)
        await assert_all_accepting(httpx.AsyncClient(), second)


async def test_altered_snapshot_refused(make_cluster: Any, sqlite_url: str, configure: Any) -> None:
    with make_cluster(None) as first:
        snapshot = await _checkpoint_mid_rollout(first, configure(first, sqlite_url))
    files = load_snapshot(snapshot).manifest["files"]
    victim = snapshot / files[0]["path"]
    victim.write_bytes(victim.read_bytes() + b"x")
    (snapshot / "stray.txt").write_text("not in the manifest")
    with make_cluster(None) as second:
        config = configure(second, sqlite_url)
        async with Coordinator.open(config) as coord:
            with pytest.raises(SnapshotError) as caught:
                await coord.restore("latest")
        differences = caught.value.differences
        assert (
            f"{files[0]['path']}: {files[0]['bytes'] + 1} bytes, the manifest says {files[0]['bytes']}"
            in differences
        )
        assert "stray.txt: not listed in the manifest" in differences
        async with httpx.AsyncClient() as http:
            logs = await control_logs(http, second)
        assert all(entry["path"] == CAPABILITIES_PATH for log in logs.values() for entry in log)
