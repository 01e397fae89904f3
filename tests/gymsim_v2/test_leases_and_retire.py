"""Leases (deadline + grace, then self-resume) and retire/forget marks."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from quiesce.coordinator.protocol_v2 import EpisodeId
from quiesce.tools.gymsim.v2.trainer import make_tasks
from tests.gymsim_v2.conftest import V2, code, eventually, running, v2_spec

pytestmark = pytest.mark.anyio


async def test_an_expired_lease_resumes_the_participant(http: httpx.AsyncClient) -> None:
    with running(v2_spec(resources={"lease_grace_s": 0.5})) as cluster:
        gym = V2(cluster.urls, http)
        reply = await gym.op("resources", "prepare", "c1", deadline_s=0.5)
        assert reply.json()["phase"] == "prepared"
        status = await gym.state("resources")
        assert status["lease_expires_at"] == pytest.approx(time.time() + 1.0, abs=0.9)

        async def idle() -> bool:
            return bool((await gym.state("resources"))["phase"] == "idle")

        await eventually(idle, what="self-resume at lease expiry")
        status = await gym.state("resources")
        assert (status["checkpoint_id"], status["lease_expires_at"]) == (None, None)
        assert code(await gym.op("resources", "renew", "c1")) == "stale_checkpoint"
        assert (await gym.op("resources", "resume", "c1")).json() == {"phase": "idle", "idempotent": True}
        assert (await gym.admin("resources", "GET", "state"))["lease_expirations"] == 1
        # the default grace (600 s) held the others
        assert (await gym.op("agent", "prepare", "c9", deadline_s=0.5)).json()["phase"] == "prepared"
        agent = await gym.state("agent")
        assert agent["lease_expires_at"] == pytest.approx(time.time() + 600.5, abs=5)


async def test_renewing_keeps_a_lease_alive(http: httpx.AsyncClient) -> None:
    with running(v2_spec(agent={"lease_grace_s": 1.0})) as cluster:
        gym = V2(cluster.urls, http)
        await gym.op("agent", "prepare", "c1", deadline_s=0.2)
        for _ in range(4):
            assert (await gym.op("agent", "renew", "c1", deadline_s=0.5)).status_code == 200
            await asyncio.sleep(0.5)
        assert (await gym.state("agent"))["phase"] == "prepared"


async def test_retire_marks_refuse_old_attempts_until_forget(gym: V2) -> None:
    trainer = gym.trainer()
    await trainer.start(make_tasks(2, turns=3), paced=True)
    await trainer.advance(1)
    await trainer.wait_parked()
    retired = await gym.op("environment", "retire", "x1", episode_ids=[{"rollout_id": "r0"}])
    assert retired.json() == {"retired": ["r0"]}
    await trainer.wait_done(["r0"])
    assert trainer.failures["r0"][0] == 409
    assert (await gym.state("environment"))["retired_rollouts"] == 1
    run = gym.urls["environment"] + "/run"
    again = await gym.http.post(run, json={"episode_id": {"rollout_id": "r0"}, "task": {"turns": 0}})
    assert (again.status_code, code(again)) == (409, "stale_attempt")
    nxt = await gym.http.post(
        run, json={"episode_id": {"rollout_id": "r0", "attempt": 1}, "task": {"turns": 0}}
    )
    assert nxt.status_code == 200
    forgotten = await gym.op("environment", "forget", "x1", rollout_ids=["r0", "b", "r0"])
    assert forgotten.json() == {"forgotten": ["b", "r0", "r0"]}
    assert (await gym.state("environment"))["retired_rollouts"] == 0
    assert (
        await gym.http.post(run, json={"episode_id": {"rollout_id": "r0"}, "task": {"turns": 0}})
    ).status_code == 200
    await trainer.unpace()
    await trainer.wait_done(["r1"])
    assert "r1" in trainer.results


async def test_agent_model_and_resources_refuse_retired_attempts(gym: V2) -> None:
    trainer = gym.trainer()
    await trainer.start({"r0": {"turns": 2}}, paced=True)
    await trainer.advance(1)
    await trainer.wait_parked()
    episode = {"rollout_id": "r0", "attempt": 0}
    for name in ("agent", "policy_model", "resources"):
        reply = await gym.op(name, "retire", "x1", episode_ids=[{"rollout_id": "r0", "attempt": 2}])
        assert reply.status_code == 200, name
    turn = await gym.http.post(
        gym.urls["agent"] + "/v1/turn", json={"episode_id": episode, "observation": "o"}
    )
    assert code(turn) == "stale_attempt"
    call = await gym.http.post(
        gym.urls["policy_model"] + "/v1/responses", json={"episode_id": episode, "input": "i"}
    )
    assert code(call) == "stale_attempt"
    verify = await gym.http.post(gym.urls["resources"] + "/verify", json={"session_id": "sess-r0"})
    assert code(verify) == "stale_attempt"
    assert (await gym.state("resources"))["retired_sessions"] == 1
    close = await gym.http.post(gym.urls["resources"] + "/close_session", json={"session_id": "sess-r0"})
    assert close.status_code == 200  # never refused
    await gym.op("resources", "forget", "x1", rollout_ids=["r0"])
    assert (await gym.state("resources"))["retired_sessions"] == 0
    assert (await gym.state("agent"))["retired_rollouts"] == 1  # marks are per server


async def test_retire_and_forget_while_restored_renew_the_lease(
    http: httpx.AsyncClient, tmp_path: Path
) -> None:
    with running() as first:
        gym = V2(first.urls, http)
        trainer = gym.trainer()
        await trainer.start(make_tasks(2, turns=3), paced=True)
        await trainer.advance(1)
        await trainer.wait_parked()
        await gym.control.checkpoint("c1", str(tmp_path), trainer.in_flight(), stop=True)
        await trainer.detach()
    with running() as second:
        gym = V2(second.urls, http)
        scope = [EpisodeId(rollout_id=r) for r in ("r0", "r1")]
        await gym.control.restore_all("r1", str(tmp_path), scope, deadline_s=10)
        lease = (await gym.state("environment"))["lease_expires_at"]
        wrong = await gym.op("environment", "retire", "zz", episode_ids=[{"rollout_id": "r0", "attempt": 1}])
        assert code(wrong) == "checkpoint_conflict"
        retire = await gym.op(
            "environment", "retire", "r1", episode_ids=[{"rollout_id": "r0", "attempt": 1}], deadline_s=100
        )
        assert retire.status_code == 200
        status = await gym.state("environment")
        assert status["lease_expires_at"] > lease
        assert status["restored_pending"] == ["r1-a1"]  # r0-a1's restored state was freed
        assert status["phase"] == "restored"
        forget = await gym.op("environment", "forget", "r1", rollout_ids=["r0"], deadline_s=200)
        assert forget.status_code == 200
        assert (await gym.state("environment"))["lease_expires_at"] > status["lease_expires_at"]
