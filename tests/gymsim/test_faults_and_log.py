"""Fault injection (each kind, from the admin route and from the launcher spec) and the control log."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from quiesce.coordinator.protocol import ModelPauseReply
from quiesce.tools.gymsim.cluster import start_cluster
from tests.gymsim.conftest import SPEC, TOKEN, Gym, code, eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

PAUSE = "/ng-control/v1/model-admission/pause"


async def test_fail_answers_the_status_and_code_without_applying(gym: Gym) -> None:
    await gym.faults(
        "policy_model", {"kind": "fail", "path": PAUSE, "status": 503, "code": "overloaded", "times": 1}
    )
    reply = await gym.op("policy_model", "pause")
    assert reply.status_code == 503
    assert code(reply) == "overloaded"
    assert await gym.fence("policy_model") == ("idle", None)
    assert (await gym.op("policy_model", "pause")).status_code == 200  # times: 1 — fired once
    assert (await gym.admin("policy_model", "GET", "faults"))["faults"][0]["left"] == 0


async def test_drop_applies_the_operation_and_loses_the_reply(gym: Gym) -> None:
    await gym.faults("policy_model", {"kind": "drop", "path": "model-admission/pause", "times": 1})
    with pytest.raises(httpx.RemoteProtocolError):
        await gym.op("policy_model", "pause")
    assert await gym.fence("policy_model") == ("prepared", "c1")  # it was applied
    replay = await gym.op("policy_model", "pause")  # the retry replays the recorded result
    assert ModelPauseReply.model_validate(replay.json()).state == "paused"
    log = await gym.admin("policy_model", "GET", "control-log")
    assert [entry["status"] for entry in log if entry["path"] == PAUSE] == [None, 200]


@pytest.mark.parametrize("when", ["before", "after"])
async def test_delay_before_or_after_applying(gym: Gym, when: str) -> None:
    await gym.faults(
        "policy_model", {"kind": "delay", "path": PAUSE, "seconds": 30, "when": when, "times": 1}
    )
    with pytest.raises(httpx.ReadTimeout):
        await gym.op("policy_model", "pause", http_timeout=0.5)
    expected = ("idle", None) if when == "before" else ("prepared", "c1")
    assert await gym.fence("policy_model") == expected


async def test_delay_then_answer(gym: Gym) -> None:
    await gym.faults("tools", {"kind": "delay", "path": "/resources-checkpoint/prepare", "seconds": 0.05})
    assert (await gym.op("tools", "prepare")).json() == {"sessions": 0, "state": "prepared"}


async def test_hang_keeps_a_model_call_in_flight_so_the_drain_never_ends(gym: Gym) -> None:
    await gym.faults("policy_model", {"kind": "hang", "path": "/v1/responses"})
    async with httpx.AsyncClient(trust_env=False, timeout=60) as other:
        pending = asyncio.create_task(
            other.post(
                gym.urls["policy_model"] + "/v1/responses",
                json={"input": "x"},
                headers={"x-nemo-gym-rollout-id": "h1"},
            )
        )

        async def in_flight() -> bool:
            return bool((await gym.admin("policy_model", "GET", "state"))["inflight_total"])

        await eventually(in_flight)
        assert (await gym.op("policy_model", "pause")).json()["state"] == "draining"
        for _ in range(3):
            status = (await gym.status("policy_model", timeout_s=0.05)).json()
            assert (status["state"], status["inflight_total"]) == ("draining", 1)
        await gym.admin("policy_model", "DELETE", "faults")
        assert (await pending).status_code == 200
    status = (await gym.status("policy_model", timeout_s=30)).json()
    assert status["state"] == "paused"


@pytest.mark.parametrize("kind", ["malformed", "wrong_schema"])
async def test_bad_replies_after_applying(gym: Gym, kind: str) -> None:
    await gym.faults("policy_model", {"kind": kind, "path": PAUSE, "times": 1})
    reply = await gym.op("policy_model", "pause")
    assert reply.status_code == 200
    if kind == "malformed":
        with pytest.raises(json.JSONDecodeError):
            json.loads(reply.content)
    else:
        with pytest.raises(ValueError, match="validation error"):
            ModelPauseReply.model_validate(reply.json())
    assert await gym.fence("policy_model") == ("prepared", "c1")


async def test_faults_on_the_data_plane_and_admin_routes_are_never_faulted(gym: Gym) -> None:
    await gym.faults(
        "tools",
        {"kind": "fail", "path": "/tools/step", "status": 500},
        {"kind": "fail", "path": "/gymsim/admin/state"},
    )
    reply = await gym.http.post(
        gym.urls["tools"] + "/tools/step", json={"input": "x"}, headers={"x-nemo-gym-rollout-id": "r1"}
    )
    assert reply.status_code == 500
    assert (await gym.admin("tools", "GET", "state"))["sessions"] == 0
    bad = await gym.http.post(
        gym.urls["tools"] + "/gymsim/admin/faults", json={"faults": [{"kind": "explode", "path": "/x"}]}
    )
    assert bad.status_code == 422


async def test_faults_from_the_launcher_spec() -> None:
    spec: dict[str, Any] = json.loads(json.dumps(SPEC))
    spec["servers"][4]["faults"] = [
        {"kind": "fail", "path": "/resources-checkpoint/commit", "status": 500, "code": "disk_full"}
    ]
    with start_cluster(spec, token=TOKEN) as cluster:
        async with httpx.AsyncClient(trust_env=False) as http:
            gym = Gym(cluster.urls, http)
            assert (await gym.op("tools", "prepare")).status_code == 200
            reply = await gym.op("tools", "commit", checkpoint_dir="/tmp/never-written")
            assert (reply.status_code, code(reply)) == (500, "disk_full")


async def test_control_log_records_every_control_request_in_order_without_the_token(gym: Gym) -> None:
    await gym.component("policy_model")  # the helper learns the route table from capabilities
    await gym.admin("policy_model", "POST", "reset-log")
    await gym.caps("policy_model")
    await gym.op("policy_model", "pause", "c1", token=None)
    await gym.op("policy_model", "pause", "c1")
    await gym.status("policy_model", "c1", timeout_s=0)
    await gym.op("policy_model", "resume", "c1", token="wrong")
    await gym.op("policy_model", "resume", "c1")
    await gym.http.post(
        gym.urls["policy_model"] + "/v1/responses", json={"input": "x"}
    )  # data plane: not logged
    log = await gym.admin("policy_model", "GET", "control-log")
    assert log == [
        {
            "method": "GET",
            "path": "/ng-control/v1/capabilities",
            "checkpoint_id": None,
            "authorized": False,
            "status": 200,
        },
        {"method": "POST", "path": PAUSE, "checkpoint_id": "c1", "authorized": False, "status": 401},
        {"method": "POST", "path": PAUSE, "checkpoint_id": "c1", "authorized": True, "status": 200},
        {
            "method": "GET",
            "path": "/ng-control/v1/model-admission/status",
            "checkpoint_id": "c1",
            "authorized": True,
            "status": 200,
        },
        {
            "method": "POST",
            "path": "/ng-control/v1/model-admission/resume",
            "checkpoint_id": "c1",
            "authorized": False,
            "status": 401,
        },
        {
            "method": "POST",
            "path": "/ng-control/v1/model-admission/resume",
            "checkpoint_id": "c1",
            "authorized": True,
            "status": 200,
        },
    ]
    assert TOKEN not in json.dumps(log)
    await gym.admin("policy_model", "POST", "reset-log")
    assert await gym.admin("policy_model", "GET", "control-log") == []


async def test_prefix_hosted_servers_and_a_benchmark_sized_spec() -> None:
    spec = {
        "servers": [
            {"kind": "model", "name": "policy_model", "prefix": True},
            {
                "kind": "agent",
                "name": "agent_{i}",
                "count": 40,
                "prefix": True,
                "policy": "policy_model",
                "resources": "tools_{i}",
            },
            {"kind": "resources", "name": "tools_{i}", "count": 40, "prefix": True},
        ]
    }
    with start_cluster(spec, token=TOKEN) as cluster:
        assert len(cluster.urls) == 81
        assert len({url.split("/s/")[0] for url in cluster.urls.values()}) == 1
        assert cluster.urls["agent_17"].endswith("/s/agent_17")
        async with httpx.AsyncClient(trust_env=False) as http:
            gym = Gym(cluster.urls, http)
            assert (await gym.caps("agent_17"))["name"] == "agent_17"
            assert (await gym.op("tools_3", "prepare")).status_code == 200
            assert await gym.fence("tools_3") == ("prepared", "c1")
            assert await gym.fence("tools_4") == ("idle", None)
            from quiesce.tools.gymsim import client as gc

            await gc.start_rollouts(http, cluster.urls["agent_17"], {"r": 2})
            done = await gc.wait_finished(http, cluster.urls["agent_17"], expect=1)
            assert done["r"]["resource_state_revisions"] == {"tools_17": 2}
            root = cluster.urls["agent_17"].split("/s/")[0]
            assert (await http.get(root + "/s/nobody/ng-control/v1/capabilities")).status_code == 404
            log = await gym.admin("agent_17", "GET", "control-log")
            assert log[0]["path"] == "/ng-control/v1/capabilities"  # paths as the server sees them


async def test_the_control_log_keeps_only_the_newest_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    from quiesce.tools.gymsim import base

    monkeypatch.setattr(base, "CONTROL_LOG_MAX", 3)  # read when a server is built
    with start_cluster(SPEC, token=TOKEN) as running:
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            gym = Gym(running.urls, http)
            for i in range(5):
                await gym.status("policy_model", f"c{i}", timeout_s=0)
            log = await gym.admin("policy_model", "GET", "control-log")
    assert [entry["checkpoint_id"] for entry in log] == ["c2", "c3", "c4"]
