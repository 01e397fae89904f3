"""The phase machine of one participant, driven by raw calls: transitions, replay, fencing, the
order of validation and auth, prepare's readiness wait."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from quiesce.coordinator.protocol_v2 import PREFIX, RESUMED_IDS_KEPT, PrepareReply, StatusReply
from tests.gymsim_v2.conftest import V2, code, eventually

pytestmark = pytest.mark.anyio


async def test_status_of_every_kind_carries_its_extras(gym: V2) -> None:
    extras: dict[str, dict[str, Any]] = {
        "environment": {"restored_pending": []},
        "policy_model": {"restored_generation_cuts": []},
        "agent": {"accepting": True},
        "resources": {"mode": "exported", "verify": "replay", "retired_sessions": 0},
    }
    for name, extra in extras.items():
        status = await gym.state(name)
        StatusReply.model_validate(status)
        assert status["instance"] == name
        assert (status["phase"], status["checkpoint_id"], status["lease_expires_at"]) == ("idle", None, None)
        assert {k: status[k] for k in extra} == extra


async def test_prepare_commit_resume_and_replays(gym: V2, tmp_path: object) -> None:
    first = await gym.op("agent", "prepare", "c1")
    assert first.status_code == 200
    assert PrepareReply.model_validate(first.json()).phase == "prepared"
    assert (await gym.op("agent", "prepare", "c1")).json() == first.json()  # replayed
    status = await gym.state("agent")
    assert (status["phase"], status["checkpoint_id"], status["accepting"]) == ("prepared", "c1", False)
    assert status["lease_expires_at"] is not None
    commit = await gym.op("agent", "commit", "c1", checkpoint_dir=str(tmp_path))
    assert commit.status_code == 200, commit.text
    assert commit.json()["phase"] == "committed"
    # a retry (any folder) replays the recorded reply
    again = await gym.op("agent", "commit", "c1", checkpoint_dir=str(tmp_path) + "/elsewhere")
    assert again.json() == commit.json()
    # prepare's recorded result is replayed even after the commit (as Gym's control plane does)
    assert (await gym.op("agent", "prepare", "c1")).json() == first.json()
    resumed = await gym.op("agent", "resume", "c1")
    assert resumed.json() == {"phase": "idle", "idempotent": False}
    assert (await gym.op("agent", "resume", "c1")).json() == {"phase": "idle", "idempotent": True}
    status = await gym.state("agent")
    assert (status["phase"], status["checkpoint_id"], status["lease_expires_at"], status["accepting"]) == (
        "idle",
        None,
        None,
        True,
    )
    for operation in ("prepare", "renew", "commit"):
        fields: dict[str, Any] = {"checkpoint_dir": str(tmp_path)} if operation == "commit" else {}
        reply = await gym.op("agent", operation, "c1", **fields)
        assert (reply.status_code, code(reply)) == (409, "stale_checkpoint"), operation


async def test_another_id_conflicts_and_wrong_phases_are_refused(gym: V2, tmp_path: object) -> None:
    assert (await gym.op("resources", "prepare", "c1")).json()["phase"] == "prepared"
    for operation, fields in (
        ("prepare", {}),
        ("renew", {}),
        ("resume", {}),
        ("commit", {"checkpoint_dir": str(tmp_path)}),
        ("restore", {"checkpoint_dir": str(tmp_path), "episode_ids": []}),
    ):
        reply = await gym.op("resources", operation, "c2", **fields)
        assert (reply.status_code, code(reply)) == (409, "checkpoint_conflict"), operation
    retire = await gym.op("resources", "retire", "c1", episode_ids=[{"rollout_id": "r0"}])
    assert (retire.status_code, code(retire)) == (409, "invalid_phase")
    assert "resume first" in retire.json()["error"]["detail"]
    forget = await gym.op("resources", "forget", "c1", rollout_ids=["r0"])
    assert (forget.status_code, code(forget)) == (409, "invalid_phase")
    idle_commit = await gym.op("agent", "commit", "c9", checkpoint_dir=str(tmp_path))
    assert (idle_commit.status_code, code(idle_commit)) == (409, "invalid_phase")
    idle_renew = await gym.op("agent", "renew", "c9")
    assert (idle_renew.status_code, code(idle_renew)) == (409, "invalid_phase")


async def test_resume_when_idle_fences_a_late_prepare(gym: V2) -> None:
    assert (await gym.op("policy_model", "resume", "late")).json() == {
        "phase": "idle",
        "idempotent": True,
    }
    reply = await gym.op("policy_model", "prepare", "late")
    assert (reply.status_code, code(reply)) == (409, "stale_checkpoint")
    assert (await gym.state("policy_model"))["phase"] == "idle"


async def test_only_the_last_64_resumed_ids_are_fenced(gym: V2) -> None:
    for i in range(RESUMED_IDS_KEPT + 1):
        await gym.op("resources", "resume", f"old-{i}")
    assert code(await gym.op("resources", "prepare", f"old-{RESUMED_IDS_KEPT}")) == "stale_checkpoint"
    oldest = await gym.op("resources", "prepare", "old-0")
    assert oldest.status_code == 200
    assert oldest.json()["phase"] == "prepared"


async def test_renew_takes_the_max_of_the_lease(gym: V2) -> None:
    await gym.op("resources", "prepare", "c1", deadline_s=100)
    lease = (await gym.state("resources"))["lease_expires_at"]
    shorter = await gym.op("resources", "renew", "c1", deadline_s=10)
    assert shorter.json() == {"lease_expires_at": lease}
    longer = (await gym.op("resources", "renew", "c1", deadline_s=1000)).json()["lease_expires_at"]
    assert longer > lease
    assert abs(longer - (time.time() + 1000 + 600)) < 60


async def test_validation_comes_before_auth_and_auth_before_the_machine(gym: V2) -> None:
    url = gym.urls["environment"] + PREFIX
    bad = await gym.op("environment", "prepare", token=None, body={"checkpoint_id": "c1"})
    assert bad.status_code == 422
    assert "detail" in bad.json()
    assert "error" not in bad.json()
    v1_shaped = await gym.op(
        "environment",
        "prepare",
        body={"checkpoint_id": "c1", "deadline_ts": time.time() + 9, "schema_version": 1},
    )
    assert v1_shaped.status_code == 422
    for body in (
        {"checkpoint_id": "-bad", "deadline_ts": time.time() + 9},
        {"checkpoint_id": "x" * 129, "deadline_ts": time.time() + 9},
    ):
        assert (await gym.op("environment", "prepare", body=body)).status_code == 422
    retire = await gym.op("environment", "retire", episode_ids=[{"rollout_id": "r-a1"}])
    assert retire.status_code == 422  # a rollout id may not end in -a<N>
    assert (await gym.op("environment", "retire", episode_ids=[])).status_code == 422
    assert (await gym.op("environment", "forget", rollout_ids=[])).status_code == 422
    assert (await gym.op("environment", "commit", checkpoint_dir="")).status_code == 422
    async with httpx.AsyncClient(trust_env=False) as own:  # uvicorn closes the connection after a 500
        nan = await own.post(
            url + "/prepare",
            content=b'{"checkpoint_id": "c1", "deadline_ts": NaN}',
            headers={"content-type": "application/json", "authorization": "Bearer x"},
        )
    assert nan.status_code == 500
    for token in (None, "wrong"):
        reply = await gym.op("environment", "prepare", token=token)
        assert (reply.status_code, code(reply)) == (401, "unauthorized")
        status = await gym.status("environment", token=token)
        assert (status.status_code, code(status)) == (401, "unauthorized")
    assert (await gym.http.get(url + "/nope")).status_code == 404
    assert (await gym.http.get(url + "/prepare")).status_code == 405
    assert (await gym.state("environment"))["phase"] == "idle"  # nothing above ran


async def test_prepare_not_ready_at_its_deadline_keeps_admission_closed(gym: V2) -> None:
    trainer = gym.trainer()
    await trainer.start({"r0": {"turns": 3}, "r1": {"turns": 3}}, paced=True)
    await trainer.hold(["r0"])
    await trainer.advance(1)
    await trainer.wait_mid_turn(["r0"])
    reply = await gym.op("environment", "prepare", "c1", deadline_s=0.5)
    assert reply.status_code == 200
    assert reply.json()["phase"] == "preparing"
    assert reply.json()["report"]["blockers"] == ["r0"]
    assert reply.json()["report"]["blocker_count"] == 1
    parked = await gym.http.post(
        gym.urls["environment"] + "/run", json={"episode_id": {"rollout_id": "new"}, "task": {}}
    )
    assert (parked.status_code, code(parked)) == (409, "checkpoint_parked")
    # the same id may call prepare again; releasing the blocker makes it ready
    waiting = asyncio.create_task(gym.op("environment", "prepare", "c1", deadline_s=30))
    await trainer.release()
    assert (await waiting).json()["phase"] == "prepared"
    assert (await gym.state("environment"))["report"]["ready"] is True
    await gym.op("environment", "resume", "c1")
    await trainer.unpace()
    assert set(await trainer.wait_results()) == {"r0", "r1"}


async def test_a_resume_during_the_wait_ends_the_prepare_at_once(gym: V2) -> None:
    trainer = gym.trainer()
    await trainer.start({"r0": {"turns": 2}}, paced=True)
    await trainer.hold(["r0"])
    await trainer.advance(1)
    await trainer.wait_mid_turn(["r0"])
    waiting = asyncio.create_task(gym.op("environment", "prepare", "c1", deadline_s=60))

    async def preparing() -> bool:
        return bool((await gym.state("environment"))["phase"] == "preparing")

    await eventually(preparing, what="prepare under way")
    assert (await gym.op("environment", "resume", "c1")).json() == {"phase": "idle", "idempotent": False}
    reply = await asyncio.wait_for(waiting, 30)
    assert reply.status_code == 200
    assert reply.json()["phase"] == "idle"
    await trainer.release()
    await trainer.unpace()
    await trainer.wait_results()


async def test_failed_restore_leaves_the_participant_idle_and_open(gym: V2, tmp_path: object) -> None:
    reply = await gym.op("agent", "restore", "r1", checkpoint_dir=str(tmp_path), episode_ids=[])
    assert (reply.status_code, code(reply)) == (422, "invalid_checkpoint_state")
    status = await gym.state("agent")
    assert (status["phase"], status["checkpoint_id"], status["accepting"]) == ("idle", None, True)
