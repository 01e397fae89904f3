"""The point of gymsim: checkpoint → SIGKILL → restore → resume finishes every rollout exactly.

R1: rollouts run uninterrupted. R2: the same rollouts in a fresh cluster process,
checkpointed mid-way by driving the control routes in the spec's order, the process
killed with SIGKILL, a new cluster process restored from the folder and resumed — which, as
on real Gym, runs nothing by itself (`released: 0`) — and the trainer's part done: `/run` sent
again for each saved execution as attempt n+1 (attempt n is refused, `stale_attempt`).
R2 must equal R1, and every turn log must show each turn exactly once (no turn
lost, none run twice), with model call ids and resource revisions continuing.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator.protocol import (
    AGENT,
    MODEL,
    RESOURCES,
    TOKEN_ENV,
    AgentCommitReply,
    AgentRestoreReply,
    ModelCommitReply,
    ModelRestoreReply,
    ResourcesCommitReply,
    ResourcesRestoreReply,
    agent_instance_dir,
    manifest_path,
    sha256_hex,
)
from quiesce.tools.gymsim import client as gc
from quiesce.tools.gymsim.cluster import spawn_cluster, start_cluster
from tests.gymsim.conftest import TOKEN, Gym, code

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

TURNS = 6
ROLLOUTS = {f"p{i}_g{i % 3}": TURNS for i in range(10)}
SPEC: dict[str, Any] = {
    "servers": [
        {"kind": "model", "name": "policy_model", "latency_s": 0.05},
        {"kind": "model", "name": "judge", "instance_role": "auxiliary"},
        {"kind": "agent", "name": "simple_agent", "policy": "policy_model", "resources": "tools"},
        {"kind": "agent", "name": "math_agent", "checkpoint_mode": "stateless", "policy": "policy_model"},
        {"kind": "resources", "name": "tools", "judge": "judge", "latency_s": 0.01},
    ]
}
ENV = {TOKEN_ENV: TOKEN}


async def uninterrupted() -> dict[str, Any]:
    with start_cluster(SPEC, token=TOKEN) as cluster:
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            agent = cluster.urls["simple_agent"]
            await gc.start_rollouts(http, agent, ROLLOUTS)
            rollouts = await gc.wait_finished(http, agent, expect=len(ROLLOUTS))
    assert gc.turn_log_problems(rollouts) == []
    assert all(r["status"] == "completed" for r in rollouts.values())
    assert all(entry["attempt_index"] == 0 for r in rollouts.values() for entry in r["turn_log"])
    return gc.final_results(rollouts)


def ok(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


async def checkpoint(gym: Gym, checkpoint_id: str, folder: Path) -> dict[str, Any]:
    """prepare (model pause → agent prepare → resources prepare → model status) and commit."""
    ok(await gym.op("policy_model", "pause", checkpoint_id, deadline_s=60))
    while True:
        reply = await gym.op("simple_agent", "prepare", checkpoint_id, deadline_s=60)
        if reply.status_code == 409 and code(reply) == "agent_prepare_incomplete":
            await asyncio.sleep(0.05)
            continue
        prepared = ok(reply)
        break
    assert prepared["ready_to_commit"] is True
    assert prepared["running"] == 0
    ok(await gym.op("tools", "prepare", checkpoint_id, deadline_s=60))
    while True:
        status = ok(await gym.status("policy_model", checkpoint_id, wait_state="paused", timeout_s=5))
        if status["state"] == "paused" and status["inflight_total"] == 0:
            break
    agent = AgentCommitReply.model_validate(
        ok(await gym.op("simple_agent", "commit", checkpoint_id, checkpoint_dir=str(folder)))
    )
    model = ModelCommitReply.model_validate(
        ok(
            await gym.op(
                "policy_model",
                "commit",
                checkpoint_id,
                checkpoint_dir=str(folder),
                continuation_indexes=[agent.continuation_index.model_dump(mode="json")],
            )
        )
    )
    resources = ResourcesCommitReply.model_validate(
        ok(await gym.op("tools", "commit", checkpoint_id, checkpoint_dir=str(folder)))
    )
    for component, name, digest in (
        (AGENT, "simple_agent", agent.manifest_digest),
        (MODEL, "policy_model", model.manifest_digest),
        (RESOURCES, "tools", resources.manifest_digest),
    ):
        assert sha256_hex((folder / manifest_path(component, name)).read_bytes()) == digest
    assert model.rollouts == agent.records == len(ROLLOUTS)
    assert resources.sessions == len(ROLLOUTS)
    return {"agent": agent, "prepared": prepared}


async def restore_and_resume(
    gym: Gym, restore_id: str, source_id: str, folder: Path, committed: AgentCommitReply
) -> None:
    model = ModelRestoreReply.model_validate(
        ok(await gym.op("policy_model", "restore", restore_id, checkpoint_dir=str(folder)))
    )
    assert model.checkpoint_id == source_id
    agent = AgentRestoreReply.model_validate(
        ok(await gym.op("simple_agent", "restore", restore_id, checkpoint_dir=str(folder)))
    )
    assert agent.source_checkpoint_id == source_id
    assert agent.continuation_index == committed.continuation_index
    resources = ResourcesRestoreReply.model_validate(
        ok(await gym.op("tools", "restore", restore_id, checkpoint_dir=str(folder)))
    )
    assert resources.source_checkpoint_id == source_id
    for name in ("policy_model", "simple_agent", "tools"):
        assert await gym.fence(name) == ("restored_paused", restore_id)
    assert ok(await gym.op("tools", "resume", restore_id))["state"] == "accepting"
    assert ok(await gym.op("policy_model", "resume", restore_id))["state"] == "accepting"
    released = ok(await gym.op("simple_agent", "resume", restore_id))
    assert released == {"state": "accepting", "released": 0}  # nothing parked in this process


def boundary_records(folder: Path) -> dict[str, dict[str, Any]]:
    """The saved records, read as real Gym's layout names them: the agent manifest's `files`."""
    agent = folder / agent_instance_dir("simple_agent")
    files = json.loads((agent / "manifest.json").read_bytes())["files"]
    records = {name: json.loads((agent / name).read_bytes()) for name in files}
    for name, record in records.items():
        assert name == f"{record['rollout_id']}.a{record['attempt_index']}.json"
    return {record["rollout_id"]: record for record in records.values()}


class Execution:
    def __init__(self, rollout_id: str, attempt_index: int) -> None:
        self.rollout_id = rollout_id
        self.attempt_index = attempt_index


async def test_checkpoint_sigkill_restore_resume_finishes_exactly_like_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    r1 = await uninterrupted()
    folder = tmp_path / "snapshot"
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        with spawn_cluster(SPEC, env=ENV, workdir=tmp_path / "first") as first:
            gym = Gym(first.urls, http)
            agent = first.urls["simple_agent"]
            await gc.start_rollouts(http, agent, ROLLOUTS)
            await gc.wait_turns(http, agent, 2)
            done = await checkpoint(gym, "ckpt-1", folder)
            first.kill()  # SIGKILL: no resume, nothing cleaned up
            assert first.returncode == -9
        records = boundary_records(folder)
        assert len(records) == len(ROLLOUTS)
        at_checkpoint = {rid: record["turns_done"] for rid, record in records.items()}
        assert all(turns >= 2 for turns in at_checkpoint.values())
        assert any(turns < TURNS for turns in at_checkpoint.values()), "checkpoint was not mid-way"

        with spawn_cluster(SPEC, env=ENV, workdir=tmp_path / "second") as second:
            gym = Gym(second.urls, http)
            await restore_and_resume(gym, "restore-1", "ckpt-1", folder, done["agent"])
            agent = second.urls["simple_agent"]
            waiting = await gc.get_rollouts(http, agent)
            assert {rid: (r["status"], r["attempt_index"]) for rid, r in waiting.items()} == {
                rid: ("restored", 1) for rid in ROLLOUTS
            }
            await asyncio.sleep(0.3)  # resumed, yet nothing runs: no turn without the trainer's /run
            assert {rid: r["turns_done"] for rid, r in (await gc.get_rollouts(http, agent)).items()} == (
                at_checkpoint
            )
            some = sorted(ROLLOUTS)[0]
            stale = await http.post(f"{agent}/run", json={"rollout_id": some, "turns": TURNS})
            assert (stale.status_code, code(stale)) == (409, "stale_attempt")  # attempt 0: retired
            assert "retired by restore" in stale.text
            later = await http.post(
                f"{agent}/run", json={"rollout_id": some, "turns": TURNS, "attempt_index": 2}
            )
            assert (later.status_code, code(later)) == (409, "rollout_exists")  # no continuation of it
            await gc.resubmit(http, agent, [Execution(rid, 1) for rid in sorted(ROLLOUTS)])
            rollouts = await gc.wait_finished(http, agent, expect=len(ROLLOUTS))
            again = await http.post(
                f"{agent}/run", json={"rollout_id": some, "turns": TURNS, "attempt_index": 1}
            )
            assert (again.status_code, code(again)) == (409, "rollout_exists")  # ran once, not twice

    assert gc.final_results(rollouts) == r1
    assert gc.turn_log_problems(rollouts) == []
    for rid, rollout in rollouts.items():
        assert rollout["status"] == "completed"
        assert rollout["attempt_index"] == 1
        k = at_checkpoint[rid]
        attempts = [entry["attempt_index"] for entry in rollout["turn_log"]]
        assert attempts == [0] * k + [1] * (TURNS - k), (rid, attempts)
        assert rollout["restored_from"] == [{"checkpoint_id": "ckpt-1", "attempt_index": 0, "turns_done": k}]


async def test_checkpoint_then_resume_in_place_changes_nothing(tmp_path: Path) -> None:
    r1 = await uninterrupted()
    with start_cluster(SPEC, token=TOKEN) as cluster:
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            gym = Gym(cluster.urls, http)
            agent = cluster.urls["simple_agent"]
            await gc.start_rollouts(http, agent, ROLLOUTS)
            await gc.start_rollouts(http, cluster.urls["math_agent"], {"m0": 3, "m1": 3})
            await gc.wait_turns(http, agent, 1)
            await checkpoint(gym, "in-place", tmp_path)
            ok(await gym.op("tools", "resume", "in-place"))
            ok(await gym.op("policy_model", "resume", "in-place"))
            ok(await gym.op("simple_agent", "resume", "in-place"))
            rollouts = await gc.wait_finished(http, agent, expect=len(ROLLOUTS))
            maths = await gc.wait_finished(http, cluster.urls["math_agent"], expect=2)
    assert gc.final_results(rollouts) == r1
    assert gc.turn_log_problems(rollouts) == []
    assert all(r["status"] == "completed" for r in maths.values())
