"""Fault injection on v2 routes, the spec's v2 options, and the launchers."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from quiesce.coordinator.protocol_v2 import PREFIX
from quiesce.tools.gymsim.cluster import spawn_cluster
from quiesce.tools.gymsim.launcher import build_spec
from quiesce.tools.gymsim.spec import ClusterSpec
from quiesce.tools.gymsim.v2.drive import ControlError
from quiesce.tools.gymsim.v2.trainer import expected_results, make_tasks
from tests.gymsim_v2.conftest import TOKEN, V2, auth, code, running, v2_spec

pytestmark = pytest.mark.anyio


async def test_restore_failing_on_one_server_then_retire_and_resume(
    http: httpx.AsyncClient, tmp_path: Path
) -> None:
    tasks = make_tasks(2, turns=3)
    with running() as first:
        gym = V2(first.urls, http)
        trainer = gym.trainer()
        await trainer.start(tasks, paced=True)
        await trainer.advance(1)
        await trainer.wait_parked()
        await gym.control.checkpoint("c1", str(tmp_path), trainer.in_flight(), stop=True)
        await trainer.detach()
    scope = trainer.in_flight()
    with running() as second:
        gym = V2(second.urls, http)
        await gym.faults(
            "agent",
            {
                "kind": "fail",
                "path": "/checkpoint/restore",
                "status": 409,
                "code": "checkpoint_error",
                "times": 1,
            },
        )
        with pytest.raises(ControlError) as failed:
            await gym.control.restore_all("r1", str(tmp_path), scope)
        assert failed.value.name == "agent"
        assert code(failed.value.reply) == "checkpoint_error"
        assert (await gym.state("agent"))["phase"] == "idle"
        assert (await gym.state("environment"))["phase"] == "restored"
        # Gym's coordinator after a failed restore: retire the next attempts everywhere, resume all
        nxt = [e.next_attempt().model_dump() for e in scope]
        for name in gym.urls:
            reply = await gym.op(name, "retire", "r1", episode_ids=nxt)
            assert reply.status_code == 200, (name, reply.text)
        await gym.control.resume_all("r1")
        assert (await gym.state("environment"))["restored_pending"] == []
        # the rollouts start over as attempt 2 and still finish exactly
        for rid in tasks:
            trainer.attempts[rid] = 1
        await trainer.continue_on(second.urls["environment"])
        assert await trainer.wait_results() == expected_results(tasks)


async def test_a_hung_route_and_a_malformed_reply(gym: V2) -> None:
    await gym.faults("agent", {"kind": "hang", "path": "/checkpoint/prepare"})
    with pytest.raises(httpx.ReadTimeout):
        await gym.http.post(
            gym.urls["agent"] + PREFIX + "/prepare",
            json={"checkpoint_id": "c1", "deadline_ts": 9e9},
            headers=auth(),
            timeout=0.5,
        )
    assert (await gym.state("agent"))["phase"] == "idle"  # a hung request never ran
    await gym.http.delete(gym.urls["agent"] + "/gymsim/admin/faults")
    await gym.faults("resources", {"kind": "malformed", "path": "/checkpoint/prepare", "times": 1})
    reply = await gym.op("resources", "prepare", "c1")
    assert reply.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        reply.json()
    assert (await gym.state("resources"))["phase"] == "prepared"  # the operation ran
    log = await gym.admin("resources", "GET", "control-log")
    assert [(e["path"], e["checkpoint_id"], e["status"]) for e in log][-2:] == [
        (PREFIX + "/prepare", "c1", 200),
        (PREFIX + "/status", None, 200),
    ]


async def test_an_auxiliary_model_is_not_a_participant(http: httpx.AsyncClient) -> None:
    spec = v2_spec()
    spec["servers"].append({"kind": "model", "plane": "v2", "name": "judge", "instance_role": "auxiliary"})
    with running(spec) as cluster:
        gym = V2(cluster.urls, http)
        assert (await gym.status("judge")).status_code == 404
        assert list(await gym.control.kinds()) == ["environment", "policy_model", "agent", "resources"]
        answer = await http.post(cluster.urls["judge"] + "/v1/responses", json={"input": "x"})
        assert answer.status_code == 200


def test_spec_rules_of_plane_v2() -> None:
    with pytest.raises(ValidationError, match="environment exists only on plane v2"):
        ClusterSpec.model_validate({"servers": [{"kind": "environment", "name": "e"}]})
    with pytest.raises(ValidationError, match="apply to plane v2 only"):
        ClusterSpec.model_validate({"servers": [{"kind": "resources", "name": "t", "lease_grace_s": 5}]})
    with pytest.raises(ValidationError, match="worker_mode coordinator"):
        ClusterSpec.model_validate(
            {
                "servers": [
                    {
                        "kind": "resources",
                        "plane": "v2",
                        "name": "t",
                        "workers": 2,
                        "worker_mode": "coordinator",
                    }
                ]
            }
        )
    with pytest.raises(ValidationError, match="names no server"):
        ClusterSpec.model_validate(
            {"servers": [{"kind": "environment", "plane": "v2", "name": "e", "agent": "nope"}]}
        )
    args = argparse.Namespace(spec=None, plane="v2", host=None, workers=[])
    assert [(s.kind, s.plane) for s in build_spec(args).servers] == [
        ("environment", "v2"),
        ("model", "v2"),
        ("agent", "v2"),
        ("resources", "v2"),
    ]
    with pytest.raises(ValueError, match="--plane"):
        build_spec(argparse.Namespace(spec="x.yaml", plane="v2", host=None, workers=[]))


async def test_spawned_v2_cluster_with_a_shared_port(tmp_path: Path) -> None:
    spec = v2_spec(agent={"prefix": True}, resources={"prefix": True})
    with spawn_cluster(spec, env={"NEMO_GYM_CHECKPOINT_CONTROL_TOKEN": TOKEN}, workdir=tmp_path) as proc:
        assert "/s/agent" in proc.urls["agent"]
        assert [e["name"] for e in proc.config()["servers"]] == [
            "environment",
            "policy_model",
            "agent",
            "resources",
        ]
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            gym = V2(proc.urls, http)
            for name in proc.urls:
                assert (await gym.state(name))["instance"] == name
            trainer = gym.trainer()
            await trainer.start({"r0": {"turns": 2}}, paced=False)
            assert await asyncio.wait_for(trainer.wait_results(), 60) == expected_results(
                {"r0": {"turns": 2}}
            )


async def test_a_lost_peer_reply_is_a_502_naming_the_transport_error(gym: V2) -> None:
    """A data-plane call whose peer drops the connection is answered with a JSON 502 that names
    the peer, the route and the transport error — never a bare 500 without a reason."""
    await gym.faults("policy_model", {"kind": "drop", "path": "/v1/responses", "times": 1})
    trainer = gym.trainer()
    await trainer.start(make_tasks(1, turns=2), paced=False)
    await trainer.wait_done(["r0"])
    status, body = trainer.failures["r0"]
    assert status == 502, body
    assert body["error"]["code"] == "bad_gateway"
    assert body["error"]["detail"].startswith("policy_model/v1/responses: RemoteProtocolError"), body
