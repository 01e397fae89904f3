"""Spec §1–2 on every reference server: capabilities, bearer auth (401), body validation (422)."""

from __future__ import annotations

import math
import time

import httpx
import pytest

from quiesce.coordinator.protocol import CAPABILITIES_PATH, UNAUTHORIZED_DETAIL, Capabilities, route
from quiesce.tools.gymsim.cluster import start_cluster
from tests.gymsim.conftest import SPEC, TOKEN, Gym, auth, code

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

CONTROL = [
    ("policy_model", "pause"),
    ("policy_model", "commit"),
    ("policy_model", "restore"),
    ("policy_model", "resume"),
    ("simple_agent", "prepare"),
    ("simple_agent", "commit"),
    ("simple_agent", "restore"),
    ("simple_agent", "resume"),
    ("tools", "prepare"),
    ("tools", "commit"),
    ("tools", "restore"),
    ("tools", "resume"),
]
STATUS = ["policy_model", "simple_agent", "tools"]


async def test_capabilities_of_the_seed_cluster(sgym: Gym) -> None:
    expected = {
        "policy_model": ("responses_api_models", "export_restore", "policy"),
        "judge": ("responses_api_models", "stateless", "auxiliary"),
        "simple_agent": ("responses_api_agents", "export_restore", None),
        "math_agent": ("responses_api_agents", "stateless", None),
        "tools": ("resources_servers", "export_restore", None),
    }
    for name, (component, mode, role) in expected.items():
        caps = Capabilities.model_validate(await sgym.caps(name))
        assert (caps.component, caps.checkpoint_mode, caps.instance_role) == (component, mode, role)
        assert caps.name == name
        assert caps.schema_version == 1
        assert caps.multi_process.mode == "single_worker"
        assert (caps.phase, caps.active_checkpoint_id, caps.deadline_ts) == ("idle", None, None)
    assert "agent_continuation_index_v1" in (await sgym.caps("simple_agent"))["features"]


async def test_capabilities_need_no_token_and_show_the_fence(gym: Gym) -> None:
    reply = await gym.http.get(gym.urls["tools"] + CAPABILITIES_PATH)
    assert reply.status_code == 200
    deadline = time.time() + 30
    ok = await gym.op("tools", "prepare", deadline_s=30)
    assert ok.status_code == 200, ok.text
    caps = await gym.caps("tools")
    assert caps["phase"] == "prepared"
    assert caps["active_checkpoint_id"] == "c1"
    assert math.isclose(caps["deadline_ts"], deadline, abs_tol=5)


@pytest.mark.parametrize(("name", "operation"), CONTROL)
@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN.upper()])
async def test_post_without_the_right_token_is_401(
    sgym: Gym, name: str, operation: str, token: str | None
) -> None:
    reply = await sgym.op(name, operation, token=token, checkpoint_dir="/tmp/x")
    assert reply.status_code == 401
    assert reply.json() == {"detail": UNAUTHORIZED_DETAIL}
    assert await sgym.fence(name) == ("idle", None)


@pytest.mark.parametrize("name", STATUS)
async def test_status_without_the_right_token_is_401(sgym: Gym, name: str) -> None:
    for token in (None, "nope"):
        reply = await sgym.status(name, token=token)
        assert reply.status_code == 401
        assert reply.json() == {"detail": UNAUTHORIZED_DETAIL}


async def test_auth_comes_before_body_validation(sgym: Gym) -> None:
    reply = await sgym.op("tools", "prepare", token=None, body={"bogus": True})
    assert reply.status_code == 401


async def test_no_token_configured_means_every_control_request_is_401() -> None:
    with start_cluster(SPEC, token=None) as cluster:
        async with httpx.AsyncClient(trust_env=False) as http:
            gym = Gym(cluster.urls, http)
            for name, operation in CONTROL:
                for token in (TOKEN, None):
                    reply = await gym.op(name, operation, token=token, checkpoint_dir="/tmp/x")
                    assert reply.status_code == 401, (name, operation)
            for name in STATUS:
                assert (await gym.status(name)).status_code == 401
            assert (await gym.http.get(cluster.urls["tools"] + CAPABILITIES_PATH)).status_code == 200


BAD_BODIES = [
    pytest.param({"checkpoint_id": "c1", "deadline_ts": 1e12, "extra": 1}, id="extra-field"),
    pytest.param({"checkpoint_id": "-bad", "deadline_ts": 1e12}, id="bad-id-start"),
    pytest.param({"checkpoint_id": "a b", "deadline_ts": 1e12}, id="bad-id-space"),
    pytest.param({"checkpoint_id": "", "deadline_ts": 1e12}, id="empty-id"),
    pytest.param({"checkpoint_id": "x" * 129, "deadline_ts": 1e12}, id="long-id"),
    pytest.param({"checkpoint_id": "c1"}, id="no-deadline"),
    pytest.param({"deadline_ts": 1e12}, id="no-id"),
    pytest.param({"checkpoint_id": "c1", "deadline_ts": "soon"}, id="text-deadline"),
    pytest.param({"checkpoint_id": "c1", "deadline_ts": 1e12, "schema_version": 2}, id="schema-2"),
    pytest.param({"checkpoint_id": "c1", "deadline_ts": 1e12, "schema_version": True}, id="schema-true"),
    pytest.param({"checkpoint_id": "c1", "deadline_ts": 1e12, "schema_version": "1"}, id="schema-text"),
]


@pytest.mark.parametrize("document", BAD_BODIES)
@pytest.mark.parametrize(
    ("name", "operation"), [("policy_model", "pause"), ("simple_agent", "prepare"), ("tools", "prepare")]
)
async def test_bad_bodies_are_422(sgym: Gym, name: str, operation: str, document: dict[str, object]) -> None:
    reply = await sgym.op(name, operation, body=document)
    assert reply.status_code == 422, reply.text
    assert "detail" in reply.json()
    assert await sgym.fence(name) == ("idle", None)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
async def test_non_finite_deadline_is_422(sgym: Gym, value: str) -> None:
    path = route("resources_servers", "prepare").full_path
    raw = f'{{"checkpoint_id": "c1", "deadline_ts": {value}}}'
    reply = await sgym.http.post(
        sgym.urls["tools"] + path, content=raw, headers={**auth(), "content-type": "application/json"}
    )
    assert reply.status_code == 422, reply.text


async def test_commit_needs_checkpoint_dir_and_model_commit_checks_index_refs(sgym: Gym) -> None:
    reply = await sgym.op("tools", "commit")  # no checkpoint_dir
    assert reply.status_code == 422
    bad_ref = {"relative_path": "../x", "sha256": "0" * 64, "records": 0, "bytes": 0}
    reply = await sgym.op("policy_model", "commit", checkpoint_dir="/tmp", continuation_indexes=[bad_ref])
    assert reply.status_code == 422


async def test_schema_version_one_is_accepted(gym: Gym) -> None:
    reply = await gym.op("tools", "prepare", schema_version=1)
    assert reply.status_code == 200, reply.text


async def test_status_query_validation_is_422(sgym: Gym) -> None:
    reply = await sgym.status("policy_model", checkpoint_id="bad id")
    assert reply.status_code == 422
    assert code(await sgym.status("policy_model")) == "invalid_phase"
