"""Restore: a snapshot taken mid-rollout, restored into a fresh cluster, finishes like an uninterrupted run
— once the caller sends `/run` again for exactly the executions the restore lists (`resubmit`:
each saved record's rollout as attempt n+1), as a trainer on real Gym must; nothing runs them before.

Also: the snapshot is verified before any server is contacted (participant mismatch, altered
file → `SnapshotError` listing every difference, only capabilities requests sent); an agent
record whose identity is not its file name, or that does not parse, no longer refuses it up front
(the resubmission list is a convenience): the agent refuses it, and nothing is resumed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator import Coordinator, PhaseError, Resubmission, SnapshotError, load_snapshot
from quiesce.coordinator.protocol import CAPABILITIES_PATH, agent_instance_dir, sha256_hex
from quiesce.ledger import Ledger
from quiesce.tools.gymsim import client
from tests.coordinator.helpers import (
    assert_all_accepting,
    assert_protocol_ok,
    control_logs,
    read_events,
    server_states,
)

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
        async with Coordinator.open(config) as coord:
            await coord.discover()  # before the rollouts: on a loaded machine they could all end meanwhile
            await client.start_rollouts(http, agent, ROLLOUTS)
            await client.wait_turns(http, agent, 2)
            attempt = await coord.checkpoint(deadline_s=30)
        rollouts = await client.get_rollouts(http, agent)
        assert any(r["status"] != "completed" for r in rollouts.values()), "checkpoint was not mid-rollout"
    assert attempt.snapshot is not None
    return attempt.snapshot


def _saved_records(snapshot: Path) -> dict[tuple[str, int], int]:
    """The agent's saved records as real Gym lays them out: (rollout_id, attempt) -> turns done."""
    folder = snapshot / agent_instance_dir("simple_agent")
    files = json.loads((folder / "manifest.json").read_bytes())["files"]
    records = [json.loads((folder / name).read_bytes()) for name in files]
    return {(r["rollout_id"], r["attempt_index"]): r["turns_done"] for r in records}


def _forge_record(snapshot: Path, content: bytes) -> str:
    """Replace one agent record with `content` and make every digest agree — the agent's manifest,
    the snapshot's file list, the agent's manifest digest — a forgery only its identity shows."""
    folder = snapshot / agent_instance_dir("simple_agent")
    agent_manifest = json.loads((folder / "manifest.json").read_bytes())
    name: str = sorted(agent_manifest["files"])[0]
    (folder / name).write_bytes(content)
    agent_manifest["files"][name] = sha256_hex(content)
    (folder / "manifest.json").write_text(json.dumps(agent_manifest, sort_keys=True))
    manifest_file = snapshot / "manifest.json"
    manifest = json.loads(manifest_file.read_bytes())
    for entry in manifest["files"]:
        if entry["path"].startswith(agent_instance_dir("simple_agent")):
            data = (snapshot / entry["path"]).read_bytes()
            entry.update(bytes=len(data), sha256=sha256_hex(data))
    agent = next(p for p in manifest["participants"] if p["name"] == "simple_agent")
    agent["manifest_digest"] = sha256_hex((folder / "manifest.json").read_bytes())
    manifest_file.write_text(json.dumps(manifest, sort_keys=True, indent=1))
    return name


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
                saved = _saved_records(snapshot)  # (rollout_id, attempt) -> turns done
                assert {rid for rid, _ in saved} == set(ROLLOUTS)
                assert attempt.resubmit == tuple(
                    Resubmission("simple_agent", rid, n + 1) for rid, n in sorted(saved)
                )
                assert attempt.resubmit_on("simple_agent") == attempt.resubmit
                assert attempt.resubmit_on("tools") == ()
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
            agent = second.urls["simple_agent"]
            await anyio.sleep(0.3)
            waiting = await client.get_rollouts(http, agent)
            assert {rid: v["status"] for rid, v in waiting.items()} == {rid: "restored" for rid, _ in saved}
            assert {rid: v["turns_done"] for rid, v in waiting.items()} == {
                rid: turns for (rid, _), turns in saved.items()
            }  # resumed, yet nothing ran: only the caller's /run continues them
            await client.resubmit(http, agent, attempt.resubmit)
            rollouts = await client.wait_finished(http, agent, timeout_s=60)
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


@pytest.mark.parametrize("forgery", ["renamed", "unparsable"])
async def test_an_agent_record_that_disagrees_with_its_name_is_left_to_the_agent(
    make_cluster: Any, sqlite_url: str, configure: Any, tmp_path: Path, forgery: str
) -> None:
    """Such a record no longer refuses the restore up front (its digests agree: the resubmission
    list is only a convenience, issue 36 item 2); the agent checks its own records and refuses it,
    so the restore fails there, nothing is resumed and the servers it reached stay paused."""
    with make_cluster(None) as first:
        snapshot = await _checkpoint_mid_rollout(first, configure(first, sqlite_url))
    folder = snapshot / agent_instance_dir("simple_agent")
    victim = sorted(json.loads((folder / "manifest.json").read_bytes())["files"])[0]
    record = json.loads((folder / victim).read_bytes())
    if forgery == "renamed":  # the file of one rollout holds another rollout's identity
        record["rollout_id"] = "elsewhere"
        content = json.dumps(record).encode()
    else:
        content = b'{"rollout_id": "r0", "attempt_index": "zero"'
    _forge_record(snapshot, content)
    # a ledger that never saw the snapshot cannot tell its manifest was rewritten: only the records can
    other = f"sqlite+aiosqlite:///{tmp_path / 'other.db'}"
    with make_cluster(None) as second:
        async with Coordinator.open(configure(second, other)) as coord:
            await coord.discover()
            with pytest.raises(PhaseError) as caught:
                await coord.restore(snapshot)
        assert caught.value.server == "simple_agent"
        assert caught.value.code == "restore_failed"
        assert caught.value.resumed == []
        assert "simple_agent" in caught.value.not_resumed
        assert len(caught.value.warnings) == 1  # the snapshot's provenance, shown with the failure
        async with httpx.AsyncClient() as http:
            states = await server_states(http, second)
        assert states["policy_model"][0] == "restored_paused"  # half-restored state does not run
