"""Discovery: participants, skipped, every refusal listed, the judge warning, config instance roles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Header
from starlette.responses import JSONResponse

from quiesce.coordinator import Coordinator, DiscoveryError, parse_config
from quiesce.coordinator.discovery import CLUSTER, classify
from quiesce.coordinator.protocol import CAPABILITIES_PATH, Capabilities
from quiesce.coordinator.protocol_v2 import STATUS_PATH as V2_STATUS_PATH
from tests.conformance.fakegym import serve
from tests.coordinator.helpers import assert_protocol_ok, control_logs, read_events

pytestmark = pytest.mark.anyio


def _caps(name: str, component: str, **extra: Any) -> Capabilities:
    return Capabilities.model_validate(
        {
            "component": component,
            "name": name,
            "schema_version": 1,
            "admission_states": ["accepting", "draining", "paused"],
            "checkpoint_mode": "export_restore",
            **extra,
        }
    )


def _config(*servers: dict[str, Any]) -> Any:
    return parse_config({"servers": list(servers)}, base_dir=Path("/tmp"))


def test_classify_rules() -> None:
    config = _config(
        {"name": "policy", "url": "http://h:1"},
        {"name": "judge", "url": "http://h:2", "instance_role": "auxiliary"},
        {"name": "agent", "url": "http://h:3"},
        {"name": "stateless_agent", "url": "http://h:4"},
        {"name": "tools", "url": "http://h:5"},
    )
    found = classify(
        config,
        {
            "policy": _caps("policy", "responses_api_models", instance_role="policy"),
            "judge": _caps("judge", "responses_api_models", checkpoint_mode="stateless"),
            "agent": _caps("agent", "responses_api_agents"),
            "stateless_agent": _caps("stateless_agent", "responses_api_agents", checkpoint_mode="stateless"),
            "tools": _caps("tools", "resources_servers"),
        },
    )
    assert [(m.name, m.role) for m in found.participants] == [
        ("policy", "policy"),
        ("agent", "agent"),
        ("tools", "resources"),
    ]
    assert [n for n, _ in found.skipped] == ["judge", "stateless_agent"]
    assert found.refused == ()
    assert found.warnings == ()


def test_classify_restart_only_and_drain_only() -> None:
    config = _config(
        {"name": "policy", "url": "http://h:1"},
        {"name": "agent", "url": "http://h:2"},
        {"name": "restart_agent", "url": "http://h:3"},
        {"name": "restart_tools", "url": "http://h:4"},
    )
    found = classify(
        config,
        {
            "policy": _caps(
                "policy", "responses_api_models", instance_role="policy", checkpoint_mode="stateless"
            ),
            "agent": _caps("agent", "responses_api_agents", features=["completed_result_acknowledgement"]),
            "restart_agent": _caps("restart_agent", "responses_api_agents", checkpoint_mode="restart_only"),
            "restart_tools": _caps("restart_tools", "resources_servers", checkpoint_mode="restart_only"),
        },
    )
    # a stateless policy model is drain-only: paused and resumed, never committed nor restored
    assert [(m.name, m.role, m.exports) for m in found.participants] == [
        ("policy", "policy", False),
        ("agent", "agent", True),
    ]
    assert [m.name for m in found.exporters] == ["agent"]
    skipped = dict(found.skipped)
    assert sorted(skipped) == ["restart_agent", "restart_tools"]
    assert all("restart_only" in reason and "no phase" in reason for reason in skipped.values())
    assert found.refused == ()
    assert found.features["agent"] == ("completed_result_acknowledgement",)
    assert found.features["restart_agent"] == ()
    # a restart_only policy model is skipped too, and still counts as the cluster's policy model
    only = classify(
        _config({"name": "policy", "url": "http://h:1"}),
        {
            "policy": _caps(
                "policy", "responses_api_models", instance_role="policy", checkpoint_mode="restart_only"
            )
        },
    )
    assert (only.participants, only.refused) == ((), ())
    assert [n for n, _ in only.skipped] == ["policy"]


def test_classify_refuses_every_offender() -> None:
    config = _config(
        {"name": "m1", "url": "http://h:1"},
        {"name": "m2", "url": "http://h:2", "instance_role": "policy"},
        {"name": "a", "url": "http://h:3", "instance_role": "auxiliary"},
        {"name": "old", "url": "http://h:4"},
        {"name": "gone", "url": "http://h:5"},
        {"name": "renamed", "url": "http://h:6"},
    )
    found = classify(
        config,
        {
            "m1": _caps("m1", "responses_api_models"),  # no role anywhere
            "m2": _caps("m2", "responses_api_models", instance_role="auxiliary"),  # config contradicts
            "a": _caps("a", "responses_api_agents", multi_process={"mode": "unmanaged", "num_workers": 4}),
            "old": _caps("old", "resources_servers", schema_version=2),
            "gone": "cannot be reached at http://h:5: connect: refused",
            "renamed": _caps("other", "resources_servers"),
        },
    )
    reasons = dict[str, list[str]]()
    for name, reason in found.refused:
        reasons.setdefault(name, []).append(reason)
    assert set(reasons) == {"m1", "m2", "a", "old", "gone", "renamed", CLUSTER}
    assert "instance_role" in reasons["m1"][0]
    assert "config says 'policy'" in reasons["m2"][0]
    assert any("unmanaged" in r for r in reasons["a"])
    assert any("model servers only" in r for r in reasons["a"])
    assert "schema_version 2" in reasons["old"][0]
    assert "cannot be reached" in reasons["gone"][0]
    assert "'other'" in reasons["renamed"][0]
    assert "no policy model" in reasons[CLUSTER][0]


def test_config_adds_a_missing_role_and_warns_on_two_policies() -> None:
    config = _config(
        {"name": "m1", "url": "http://h:1", "instance_role": "policy"},
        {"name": "m2", "url": "http://h:2"},
    )
    found = classify(
        config,
        {
            "m1": _caps("m1", "responses_api_models"),
            "m2": _caps("m2", "responses_api_models", instance_role="policy"),
        },
    )
    assert found.refused == ()
    assert [m.name for m in found.group("policy")] == ["m1", "m2"]
    assert len(found.warnings) == 1
    assert "m1, m2" in found.warnings[0]
    assert "instance_role: auxiliary" in found.warnings[0]


async def test_refusal_against_real_servers(make_cluster: Any, sqlite_url: str, configure: Any) -> None:
    spec = {
        "servers": [
            {"kind": "model", "name": "judge", "instance_role": "auxiliary"},
            {"kind": "agent", "name": "agent", "policy": "judge", "workers": 4},
            {"kind": "resources", "name": "tools", "workers": 2},
        ]
    }
    with make_cluster(spec) as running:
        config = configure(running, sqlite_url)
        async with Coordinator.open(config) as coord:
            with pytest.raises(DiscoveryError) as caught:
                await coord.discover()
        async with httpx.AsyncClient() as http:
            logs = await control_logs(http, running)
    error = caught.value
    names = [name for name, _ in error.reasons]
    assert names == ["agent", "tools", CLUSTER]
    assert "4 unmanaged workers" in str(error)
    assert "2 unmanaged workers" in str(error)
    assert "no policy model" in str(error)
    assert all(entry["path"] == CAPABILITIES_PATH for log in logs.values() for entry in log)
    recorded = [ev for ev in await read_events(sqlite_url) if ev.kind == "discovery.completed"]
    assert [r["name"] for r in recorded[0].data["refused"]] == names


async def test_two_policy_models_warn(make_cluster: Any, sqlite_url: str, configure: Any) -> None:
    spec = {
        "servers": [
            {"kind": "model", "name": "policy_model"},
            {"kind": "model", "name": "reward_model"},
            {"kind": "agent", "name": "agent", "policy": "policy_model"},
        ]
    }
    with make_cluster(spec) as running:
        config = configure(running, sqlite_url)
        async with Coordinator.open(config) as coord:
            found = await coord.discover()
            attempt = await coord.checkpoint(deadline_s=20)
    assert found.warnings
    assert "policy_model, reward_model" in found.warnings[0]
    assert "instance_role: auxiliary" in found.warnings[0]
    assert attempt.snapshot is not None
    recorded = [ev for ev in await read_events(sqlite_url) if ev.kind == "discovery.completed"]
    assert recorded[0].data["warnings"] == list(found.warnings)


def _v2_server(token: str) -> FastAPI:
    """A server speaking Gym's unified checkpoint control plane: a bearer-guarded
    `/ng-control/v1/checkpoint/status`, no capabilities route."""
    app = FastAPI()

    @app.get(V2_STATUS_PATH)
    async def status(authorization: str | None = Header(default=None)) -> JSONResponse:
        if authorization != f"Bearer {token}":
            return JSONResponse({"error": {"code": "unauthorized", "detail": "bad token"}}, status_code=401)
        return JSONResponse(
            {
                "kind": "resources",
                "instance": "sandbox",
                "phase": "idle",
                "checkpoint_id": None,
                "lease_expires_at": None,
                "retired_rollouts": 0,
                "report": {"ready": True, "blockers": [], "blocker_count": 0, "counts": {}, "restarts": []},
            }
        )

    return app


async def test_a_cluster_mixing_the_two_planes_is_refused_naming_each_servers_plane(
    make_cluster: Any, sqlite_url: str, tmp_path: Path, token: str
) -> None:
    # v1 servers (capabilities) beside a unified-plane server (no capabilities route, its status
    # answers): refused as a whole, each server's plane named; a server answering neither is not
    # a participant, with the reason
    with make_cluster(None) as running, serve(_v2_server(token)) as v2, serve(FastAPI()) as plain:
        document = running.config(sqlite_url, tmp_path / "snapshots")
        document["servers"] += [{"name": "sandbox", "url": v2}, {"name": "blank", "url": plain}]
        async with Coordinator.open(parse_config(document, base_dir=tmp_path)) as coord:
            with pytest.raises(DiscoveryError) as caught:
                await coord.discover()
    reasons = dict(caught.value.reasons)
    assert set(reasons) == {"(cluster)", "blank"}
    assert "sandbox speaks v2" in reasons["(cluster)"]
    assert "policy_model speaks v1" in reasons["(cluster)"]
    assert "different checkpoint control planes" in reasons["(cluster)"]
    assert "not a checkpoint participant" in reasons["blank"]
    probes = [
        ev
        for ev in await read_events(sqlite_url)
        if ev.kind == "call.sent" and "checkpoint/status" in ev.data["path"]
    ]
    assert sorted(str(ev.server) for ev in probes) == [
        "blank",
        "sandbox",
    ]  # asked, and recorded, as every call
    await assert_protocol_ok(sqlite_url)  # the audit reads a ledger holding such probes


async def test_a_v1_policy_model_alone_in_a_folder_leaves_its_agents_refused(
    make_cluster: Any, sqlite_url: str, configure: Any
) -> None:
    # the servers of one folder are one deployment: a v1 model's commit takes the indexes of its
    # own folder's agents only, so an agent without a policy model in its folder is refused
    # (folders on v1: tests/coordinator/test_folders_v1.py)
    with make_cluster(None) as running:
        document = configure(running, sqlite_url).model_dump(mode="json")
        assert document["servers"][0]["name"] == "policy_model"
        document["servers"][0]["folder"] = "gym-instances/d0"
        config = parse_config(document, base_dir=Path(sqlite_url.split("///", 1)[1]).parent)
        async with Coordinator.open(config) as coord:
            with pytest.raises(DiscoveryError) as caught:
                await coord.discover()
    assert [name for name, _ in caught.value.reasons] == ["simple_agent"]
    assert "the snapshot's top folder, which holds no policy model" in str(caught.value)
