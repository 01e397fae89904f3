"""Per-kind rules: restart-only agents and resources, the model's scope rules, blockers, admission,
restores only into fresh servers, restored-but-unstarted episodes carried by the next commit."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from quiesce.coordinator.protocol_v2 import EpisodeId
from quiesce.tools.gymsim.v2.trainer import expected_results, make_tasks
from tests.gymsim_v2.conftest import V2, code, running, v2_spec

pytestmark = pytest.mark.anyio


def _ids(*keys: str) -> list[dict[str, object]]:
    return [EpisodeId(rollout_id=k).model_dump() for k in keys]


async def test_model_commit_needs_a_scope_and_exports_only_it(gym: V2, tmp_path: Path) -> None:
    trainer = gym.trainer()
    await trainer.start(make_tasks(2, turns=3), paced=True)
    await trainer.advance(1)
    await trainer.wait_parked()
    await gym.op("policy_model", "prepare", "c1")
    unscoped = await gym.op("policy_model", "commit", "c1", checkpoint_dir=str(tmp_path))
    assert (unscoped.status_code, code(unscoped)) == (409, "checkpoint_error")
    assert (await gym.state("policy_model"))["phase"] == "prepared"
    scoped = await gym.op(
        "policy_model", "commit", "c1", checkpoint_dir=str(tmp_path), episode_ids=_ids("r1")
    )
    assert scoped.status_code == 200, scoped.text
    assert scoped.json()["episode_ids"] == ["r1"]
    other_scope = await gym.op(
        "policy_model", "commit", "c1", checkpoint_dir=str(tmp_path), episode_ids=_ids("r0")
    )
    assert other_scope.json() == scoped.json()  # committed: replayed, whatever the scope


async def test_commit_retry_with_another_scope_before_success_is_a_conflict(gym: V2, tmp_path: Path) -> None:
    await gym.op("agent", "prepare", "c1")
    await gym.faults("agent", {"kind": "delay", "path": "/checkpoint/commit", "when": "during", "seconds": 2})
    slow = await gym.op(
        "agent", "commit", "c1", checkpoint_dir=str(tmp_path), episode_ids=_ids("r0"), deadline_s=1
    )
    assert (slow.status_code, code(slow)) == (409, "deadline_exceeded")
    await gym.http.delete(gym.urls["agent"] + "/gymsim/admin/faults")
    other = await gym.op("agent", "commit", "c1", checkpoint_dir=str(tmp_path), episode_ids=_ids("r1"))
    assert (other.status_code, code(other)) == (409, "checkpoint_conflict")
    same = await gym.op("agent", "commit", "c1", checkpoint_dir=str(tmp_path), episode_ids=_ids("r0"))
    assert same.status_code == 200, same.text


async def test_a_passed_deadline_refuses_commit_restore_retire_forget(gym: V2, tmp_path: Path) -> None:
    await gym.op("resources", "prepare", "c1")
    commit = await gym.op("resources", "commit", "c1", checkpoint_dir=str(tmp_path), deadline_s=-1)
    assert code(commit) == "deadline_exceeded"
    assert not (tmp_path / "gym").exists()  # before any write
    await gym.op("resources", "resume", "c1")
    for operation, fields in (
        ("restore", {"checkpoint_dir": str(tmp_path), "episode_ids": []}),
        ("retire", {"episode_ids": _ids("r0")}),
        ("forget", {"rollout_ids": ["r0"]}),
    ):
        reply = await gym.op("resources", operation, "c2", deadline_s=-1, **fields)
        assert (reply.status_code, code(reply)) == (409, "deadline_exceeded"), operation
    assert (await gym.state("resources"))["retired_rollouts"] == 0


async def test_restart_only_agent_and_resources(http: httpx.AsyncClient, tmp_path: Path) -> None:
    spec = v2_spec(agent={"checkpoint_mode": "restart_only"}, resources={"checkpoint_mode": "restart_only"})
    tasks = make_tasks(2, turns=3)
    with running(spec) as first:
        gym = V2(first.urls, http)
        trainer = gym.trainer()
        await trainer.start(tasks, paced=True)
        await trainer.advance(1)
        await trainer.wait_parked()
        prepared = await gym.control.prepare_all("c1")
        assert {n: r["phase"] for n, r in prepared.items()} == dict.fromkeys(prepared, "prepared")
        for name in ("environment", "agent", "resources"):
            assert prepared[name]["report"]["restarts"] == ["r0", "r1"], name
            assert prepared[name]["report"]["blockers"] == []
        assert (await gym.state("resources"))["mode"] == "restart_only"
        in_scope = await gym.op("agent", "commit", "c1", checkpoint_dir=str(tmp_path), episode_ids=_ids("r0"))
        assert (in_scope.status_code, code(in_scope)) == (409, "restart_in_scope")
        unscoped = await gym.op("agent", "commit", "c1", checkpoint_dir=str(tmp_path))
        assert unscoped.status_code == 200
        assert unscoped.json()["episode_ids"] == []
        assert unscoped.json()["manifest"]["record_count"] == 0
        env = await gym.op("environment", "commit", "c1", checkpoint_dir=str(tmp_path))
        assert env.json()["episode_ids"] == []  # restarts are not exported
        await gym.control.resume_all("c1")
        await trainer.detach()
    (tmp_path / "gym/agent/agent").mkdir(parents=True, exist_ok=True)
    with running(spec) as second:
        gym = V2(second.urls, http)
        # the restarts start over as attempt 1 (nothing restored) and still finish exactly
        await trainer.continue_on(second.urls["environment"])
        assert await trainer.wait_results() == expected_results(tasks)


async def test_restart_only_restore_with_records_is_refused(http: httpx.AsyncClient, tmp_path: Path) -> None:
    with running() as first:
        gym = V2(first.urls, http)
        trainer = gym.trainer()
        await trainer.start(make_tasks(1, turns=3), paced=True)
        await trainer.advance(1)
        await trainer.wait_parked()
        await gym.control.checkpoint("c1", str(tmp_path), trainer.in_flight())
        await trainer.detach()
    spec = v2_spec(agent={"checkpoint_mode": "restart_only"}, resources={"checkpoint_mode": "restart_only"})
    with running(spec) as second:
        gym = V2(second.urls, http)
        for name in ("agent", "resources"):
            reply = await gym.op(name, "restore", "r1", checkpoint_dir=str(tmp_path), episode_ids=_ids("r0"))
            assert (reply.status_code, code(reply)) == (409, "checkpoint_error"), name
            assert (await gym.state(name))["phase"] == "idle"


async def test_restore_only_into_a_fresh_server(gym: V2, tmp_path: Path) -> None:
    trainer = gym.trainer()
    await trainer.start(make_tasks(1, turns=3), paced=True)
    await trainer.advance(1)
    await trainer.wait_parked()
    await gym.control.checkpoint("c1", str(tmp_path), trainer.in_flight())
    for name in ("environment", "policy_model", "agent", "resources"):
        reply = await gym.op(name, "restore", "r1", checkpoint_dir=str(tmp_path), episode_ids=_ids("r0"))
        assert (reply.status_code, code(reply)) == (409, "checkpoint_error"), name
        status = await gym.state(name)
        assert (status["phase"], status["checkpoint_id"]) == ("idle", None)
    await trainer.unpace()
    await trainer.wait_results()


async def test_blockers_are_capped_and_counted(gym: V2) -> None:
    tasks = make_tasks(105, turns=2)
    trainer = gym.trainer()
    await trainer.start(tasks, paced=True)
    await trainer.hold(list(tasks))
    await trainer.advance(1)
    await trainer.wait_mid_turn(list(tasks))
    reply = (await gym.op("environment", "prepare", "c1", deadline_s=0.3)).json()
    assert reply["phase"] == "preparing"
    assert reply["report"]["blocker_count"] == 105
    assert reply["report"]["blockers"] == sorted(tasks)[:100]
    assert reply["report"]["counts"]["episodes"] == 105
    await gym.op("environment", "resume", "c1")
    await trainer.release()
    await trainer.unpace()
    assert len(await trainer.wait_results()) == 105


async def test_model_holds_responses_while_closed(gym: V2) -> None:
    await gym.op("policy_model", "prepare", "c1")
    call = gym.http.post(
        gym.urls["policy_model"] + "/v1/responses",
        json={"episode_id": {"rollout_id": "r0"}, "input": "x"},
        timeout=0.5,
    )
    with pytest.raises(httpx.ReadTimeout):
        await call  # waits while admission is closed
    await gym.op("policy_model", "resume", "c1")
    reply = await gym.http.post(
        gym.urls["policy_model"] + "/v1/responses", json={"episode_id": {"rollout_id": "r0"}, "input": "x"}
    )
    assert reply.status_code == 200


async def test_restored_but_unstarted_episodes_ride_the_next_commit(
    http: httpx.AsyncClient, tmp_path: Path
) -> None:
    tasks = make_tasks(3, turns=4)
    first_dir, second_dir = tmp_path / "a", tmp_path / "b"
    with running() as first:
        gym = V2(first.urls, http)
        trainer = gym.trainer()
        await trainer.start(tasks, paced=True)
        await trainer.advance(2)
        await trainer.wait_parked()
        await gym.control.checkpoint("c1", str(first_dir), trainer.in_flight(), stop=True)
        await trainer.detach()
    scope = trainer.in_flight()
    with running() as second:
        gym = V2(second.urls, http)
        await gym.control.restore_all("r1", str(first_dir), scope)
        await gym.control.resume_all("r1")
        # r0's replacement runs; r1 and r2 are never started here; r2 is left out of the next scope
        await trainer.continue_on(second.urls["environment"], ["r0"], paced=True)
        await trainer.wait_parked()
        next_scope = [EpisodeId(rollout_id=r, attempt=1) for r in ("r0", "r1")]
        commits = await gym.control.checkpoint("c2", str(second_dir), next_scope, stop=True)
        assert commits["environment"]["episode_ids"] == ["r0-a1", "r1-a1"]
        assert commits["agent"]["episode_ids"] == ["r0-a1", "r1-a1"]
        assert commits["policy_model"]["episode_ids"] == ["r0-a1", "r1-a1"]
        assert (await gym.state("environment"))["restored_pending"] == ["r1-a1"]  # r2-a1 deleted
        await trainer.detach()
    with running() as third:
        gym = V2(third.urls, http)
        restored = await gym.control.restore_all("r2", str(second_dir), next_scope)
        assert restored["environment"]["restored"] == ["r0-a2", "r1-a2"]
        await gym.control.resume_all("r2")
        trainer.attempts["r2"] = 1  # r2 starts over as attempt 2 (its restore was dropped)
        await trainer.continue_on(third.urls["environment"])
        assert await trainer.wait_results() == expected_results(tasks)
