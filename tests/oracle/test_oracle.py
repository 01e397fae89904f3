"""The oracle itself: its strict models refuse the drift real RL refuses, and its hook — always on
(tests/conftest.py) — sees the live traffic of the reference servers and the coordinator and turns
any drift into a failing test."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from quiesce.coordinator import Coordinator, parse_config
from quiesce.coordinator.calls import Caller, Target
from quiesce.coordinator.protocol import AGENT, CommonBody, route
from quiesce.ledger import Ledger
from quiesce.tools.gymsim import client
from quiesce.tools.gymsim.agent import AgentServer
from quiesce.tools.gymsim.cluster import start_cluster
from tests.oracle import models as m
from tests.oracle.wire import Violations, check_reply

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

TOKEN = "oracle-test-token-41d2"


def execution(**extra: Any) -> dict[str, Any]:
    return {
        "rollout_id": "r1",
        "attempt_index": 0,
        "generation": 1,
        "state": "parked",
        "parked_boundary_state": "parked_with_boundary",
        "boundary_index": 2,
        "age_seconds": 0.5,
        **extra,
    }


PREPARED: dict[str, Any] = {
    "state": "preparing",
    "ready_to_commit": True,
    "running": 0,
    "parked": 1,
    "parked_with_boundary": 1,
    "parked_without_boundary": 0,
    "completed_unacknowledged": 0,
    "active": 1,
    "blocking_attempts": [],
    "completed_unacknowledged_attempts": [],
    "executions": [execution()],
}

STATUS: dict[str, Any] = {
    "checkpoint_id": "c1",
    "state": "draining",
    "per_worker": {"0": {"state": "draining", "inflight": 1}},
    "inflight_total": 1,
    "waiters_total": 0,
    "inflight": [{"rollout_id": None, "attempt_index": None, "plane": None, "age_seconds": 2.5}],
    "tombstones": [],
}


@pytest.mark.parametrize(
    ("model", "document"),
    [
        pytest.param(m.AgentPrepareReply, {**PREPARED, "failed": 0}, id="agent prepare: an extra field"),
        pytest.param(m.AgentPrepareReply, {**PREPARED, "state": "paused"}, id="agent prepare: state paused"),
        pytest.param(
            m.AgentPrepareReply,
            {**PREPARED, "executions": [{"rollout_id": "r1", "attempt_index": 0}]},
            id="agent prepare: bare execution ids",
        ),
        pytest.param(
            m.ModelCommitReply,
            {"rollouts": 0, "rows": 0, "excluded_tombstoned": 0, "manifest_digest": "0" * 64},
            id="model commit: no storage_reference_index",
        ),
        pytest.param(
            m.ResourcesStatusReply,
            {
                "checkpoint_id": "c1",
                "state": "prepared",
                "admission_state": "paused",
                "sessions": 0,
                "per_session": [],
            },
            id="resources status: the fence phase as state",
        ),
        pytest.param(
            m.ModelRestoreReply,
            {
                "rollouts": 1,
                "rows": 1,
                "checkpoint_id": "c1",
                "tombstones": [],
                "source_attempts": [{"rollout_id": "r1", "attempt_index": 0, "capture_key": "r1"}],
            },
            id="model restore: source attempts with extra fields",
        ),
        pytest.param(m.SingleWorkerStatus, {**STATUS, "state": "prepared"}, id="model status: unknown state"),
    ],
)
def test_the_models_refuse_what_rl_refuses(model: type[BaseModel], document: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        model.model_validate(document)


def test_the_models_accept_what_real_gym_sends() -> None:
    m.AgentPrepareReply.model_validate(PREPARED)
    m.SingleWorkerStatus.model_validate(STATUS)  # plane null: real Gym, no x-nemo-gym-plane header
    m.CoordinatorStatus.model_validate(
        {
            "state": "paused",
            "workers": {"acknowledged": 2, "expected": 2, "live": 2},
            "missing_workers": 0,
            "inflight_total": 0,
            "waiters_total": 0,
            "per_worker": {"0": {"acked_seq": 3, "inflight": 0, "connected": True}},
        }
    )
    restored: dict[str, Any] = {
        "rollouts": 0,
        "rows": 0,
        "checkpoint_id": None,
        "tombstones": [],
        "source_attempts": [],
    }
    asked = {"checkpoint_id": "c2", "deadline_ts": time.time(), "checkpoint_dir": "/x"}
    assert check_reply(("responses_api_models", "restore"), 200, restored, asked) is None
    problem = check_reply(
        ("responses_api_models", "restore"), 200, restored, {**asked, "include_storage_reference_index": True}
    )
    assert problem == "model restore reply lacks storage_reference_index, but the request asked for it"


async def test_the_hook_turns_a_drifting_reply_into_a_failure(
    wire_oracle: Violations, monkeypatch: pytest.MonkeyPatch
) -> None:
    counters = AgentServer._counters

    def drifted(self: AgentServer) -> dict[str, Any]:
        return {**counters(self), "failed": 0}  # what gymsim used to send: RL rejects the field

    monkeypatch.setattr(AgentServer, "_counters", drifted)
    spec = {
        "servers": [
            {"kind": "model", "name": "policy_model"},
            {"kind": "agent", "name": "simple_agent", "policy": "policy_model"},
        ]
    }
    with start_cluster(spec, token=TOKEN) as running:
        url = running.urls["simple_agent"] + route(AGENT, "prepare").full_path
        async with httpx.AsyncClient() as http:
            body = {"checkpoint_id": "c1", "deadline_ts": time.time() + 10}
            reply = await http.post(url, json=body, headers={"authorization": f"Bearer {TOKEN}"})
            assert reply.status_code == 200
    problems = wire_oracle.take()  # taken back: this test provoked them
    assert len(problems) == 1, problems
    assert (
        "responses_api_agents prepare does not match the anchor: failed: Extra inputs are not permitted"
        in (problems[0])
    )


class _DriftedBody(CommonBody):
    model_config = ConfigDict(extra="allow", frozen=True)


async def test_the_hook_checks_what_the_coordinator_sends(
    wire_oracle: Violations, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEMO_GYM_CHECKPOINT_CONTROL_TOKEN", TOKEN)
    ledger_url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    with start_cluster(None, token=TOKEN) as running:
        config = parse_config(running.config(ledger_url, tmp_path / "snapshots"), base_dir=tmp_path)
        async with httpx.AsyncClient() as http:
            await http.post(f"{running.urls['policy_model']}/gymsim/admin/options", json={"latency_s": 0.02})
            await client.start_rollouts(http, running.urls["simple_agent"], {"r0": 10_000})
            await client.wait_turns(http, running.urls["simple_agent"], 1)
        before = wire_oracle.requests_checked
        async with Coordinator.open(config) as coord:
            await coord.discover()
            await coord.checkpoint()
        assert wire_oracle.requests_checked - before >= 9  # pause, status, prepare, commits, resumes...
        assert wire_oracle.take() == []
        # a request that drifts (an extra field) from the coordinator's own client is caught
        async with Ledger.open(ledger_url) as ledger:
            await ledger.start_epoch({"coordinator": {"host": "h", "pid": 1, "uuid": "u"}, "version": "t"})
            caller = Caller(ledger, TOKEN, epoch=ledger.epoch)
            try:
                target = Target("simple_agent", AGENT, running.urls["simple_agent"])
                body = _DriftedBody.model_validate(
                    {"checkpoint_id": "c9", "deadline_ts": time.time() + 5, "unexpected": 1}
                )
                result = await caller.call(
                    target,
                    route(AGENT, "resume"),
                    phase="test",
                    checkpoint_id="c9",
                    deadline_ts=time.time() + 5,
                    body=body,
                )
                assert result.status == 422  # the server refuses it too
            finally:
                await caller.aclose()
    problems = wire_oracle.take()
    assert len(problems) == 1, problems
    assert "request responses_api_agents resume does not match ControlRequest: unexpected" in problems[0]
