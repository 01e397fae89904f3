"""The oracle of the unified plane (v2): its strict models refuse drift from the spec (a null field
nobody asked for, an extra field, a capture-key string where an episode object belongs, a kind's
field missing or another kind's present, ...), accept what real Gym sends, and its hook judges the
live traffic of the v2 reference servers and of the coordinator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, ValidationError

from quiesce.coordinator import Coordinator, parse_config
from quiesce.tools.gymsim.cluster import start_cluster
from quiesce.tools.gymsim.spec import default_v2_spec
from quiesce.tools.gymsim.v2.environment import EnvironmentParticipant
from quiesce.tools.gymsim.v2.trainer import Trainer, make_tasks
from tests.oracle import models_v2 as m2
from tests.oracle.wire import Violations, check_reply_v2, check_request_v2

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

TOKEN = "oracle-v2-test-token-7c3e"
SHA = "ab" * 32

REPORT: dict[str, Any] = {"ready": True, "blockers": [], "blocker_count": 0, "counts": {}, "restarts": []}
STATUS: dict[str, Any] = {
    "kind": "environment",
    "instance": "environment",
    "phase": "prepared",
    "checkpoint_id": "c1",
    "lease_expires_at": 1_900_000_000.5,
    "retired_rollouts": 0,
    "report": REPORT,
    "restored_pending": [],
}
MANIFEST: dict[str, Any] = {
    "schema_version": 1,
    "kind": "model",
    "instance": "policy_model",
    "checkpoint_id": "c1",
    "records_file": f"records-{SHA}.jsonl",
    "records_sha256": SHA,
    "record_count": 1,
}
MODEL_COMMIT: dict[str, Any] = {
    "phase": "committed",
    "manifest": MANIFEST,
    "episode_ids": ["r1"],
    "staging_keys": ["k1"],
    "staging_keys_by_episode": {"r1": ["k1"]},
}
COMMIT_REQUEST: dict[str, Any] = {
    "checkpoint_id": "c1",
    "deadline_ts": 1_900_000_000.0,
    "checkpoint_dir": "/ckpt",
    "episode_ids": [{"rollout_id": "r1", "attempt": 0}],
    "stop": False,
}


def without(document: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in document.items() if k != key}


@pytest.mark.parametrize(
    ("model", "document"),
    [
        pytest.param(m2.EnvironmentStatus, {**STATUS, "retired_rollouts": None}, id="status: a null count"),
        pytest.param(m2.EnvironmentStatus, {**STATUS, "schema_version": 1}, id="status: an extra field"),
        pytest.param(
            m2.EnvironmentStatus, without(STATUS, "restored_pending"), id="status: its kind's field"
        ),
        pytest.param(
            m2.EnvironmentStatus,
            {**STATUS, "phase": "idle", "checkpoint_id": None},
            id="status: idle, a lease",
        ),
        pytest.param(m2.EnvironmentStatus, {**STATUS, "checkpoint_id": None}, id="status: prepared, no id"),
        pytest.param(m2.EnvironmentStatus, {**STATUS, "phase": "committed_paused"}, id="status: a v1 phase"),
        pytest.param(m2.EnvironmentStatus, {**STATUS, "workers": 2}, id="status: half the worker fields"),
        pytest.param(m2.ModelStatus, {**STATUS, "kind": "model"}, id="status: a model without cut list"),
        pytest.param(
            m2.ResourcesStatus,
            {**without(STATUS, "restored_pending"), "kind": "resources", "mode": "export_restore"}
            | {"verify": "wait", "retired_sessions": 0},
            id="status: resources mode in v1's words",
        ),
        pytest.param(
            m2.AgentStatus,
            {**without(STATUS, "restored_pending"), "kind": "agent", "accepting": "yes"},
            id="status: accepting not a bool",
        ),
        pytest.param(
            m2.PrepareReply, {"phase": "prepared", "report": without(REPORT, "restarts")}, id="report"
        ),
        pytest.param(
            m2.PrepareReply,
            {"phase": "prepared", "report": {**REPORT, "blockers": ["r1"], "blocker_count": 1}},
            id="report: ready with a blocker",
        ),
        pytest.param(m2.ResumeReply, {"phase": "idle", "idempotent": None}, id="resume: null idempotent"),
        pytest.param(m2.ResumeReply, {"phase": "idle"}, id="resume: idempotent left out"),
        pytest.param(m2.ModelCommitReply, without(MODEL_COMMIT, "staging_keys"), id="model commit: no keys"),
        pytest.param(
            m2.ModelCommitReply,
            {**MODEL_COMMIT, "staging_keys": ["k2", "k1"]},
            id="model commit: unsorted keys",
        ),
        pytest.param(m2.CommitReply, MODEL_COMMIT, id="environment commit: a model's fields"),
        pytest.param(
            m2.CommitReply,
            {**without(MODEL_COMMIT, "staging_keys"), "episode_ids": ["r2", "r1"]}
            | {"staging_keys_by_episode": {}},
            id="commit: episode ids unsorted",
        ),
        pytest.param(
            m2.ModelCommitReply,
            {**MODEL_COMMIT, "manifest": {**MANIFEST, "records_file": "records.jsonl"}},
            id="commit: the legacy records name",
        ),
        pytest.param(
            m2.ModelCommitReply,
            {**MODEL_COMMIT, "manifest": {**MANIFEST, "records_sha256": "cd" * 32}},
            id="commit: a records file not named by its digest",
        ),
        pytest.param(
            m2.RestoreReply,
            {"phase": "restored", "source_checkpoint_id": "c1", "restored": ["r2-a1", "r1-a1"]},
            id="restore: unsorted",
        ),
        pytest.param(m2.ForgetReply, {"forgotten": ["b", "a"]}, id="forget: unsorted"),
        pytest.param(m2.RenewReply, {"lease_expires_at": None}, id="renew: a null lease"),
        pytest.param(m2.CommitRequest, {**COMMIT_REQUEST, "schema_version": 1}, id="request: schema_version"),
        pytest.param(
            m2.CommitRequest, {**COMMIT_REQUEST, "episode_ids": ["r1"]}, id="request: a capture key"
        ),
        pytest.param(
            m2.CommitRequest,
            {**COMMIT_REQUEST, "episode_ids": [{"rollout_id": "r1-a1", "attempt": 0}]},
            id="request: a rollout id ending in -a1",
        ),
        pytest.param(
            m2.CommitRequest,
            {**COMMIT_REQUEST, "episode_ids": [{"rollout_id": "r1", "attempt": "1"}]},
            id="request: an attempt as text",
        ),
        pytest.param(
            m2.CommitRequest,
            {**COMMIT_REQUEST, "episode_ids": [{"rollout_id": "r1", "attempt": 0, "capture_key": "r1"}]},
            id="request: an episode with an extra field",
        ),
        pytest.param(m2.CommitRequest, {**COMMIT_REQUEST, "checkpoint_dir": ""}, id="request: an empty dir"),
        pytest.param(m2.CommitRequest, {**COMMIT_REQUEST, "stop": None}, id="request: a null stop"),
        pytest.param(m2.RestoreRequest, without(COMMIT_REQUEST, "episode_ids"), id="restore: no scope"),
        pytest.param(
            m2.RetireRequest,
            {"checkpoint_id": "c1", "deadline_ts": 1.0, "episode_ids": []},
            id="retire: none",
        ),
        pytest.param(
            m2.CheckpointRequest,
            {"checkpoint_id": "c1", "deadline_ts": "1.5"},
            id="request: a deadline as text",
        ),
        pytest.param(m2.Refusal, {"error": {"code": "invalid_phase"}}, id="refusal: no detail"),
    ],
)
def test_the_models_refuse_drift(model: type[BaseModel], document: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        model.model_validate(document)


def test_the_models_accept_what_real_gym_sends() -> None:
    m2.EnvironmentStatus.model_validate(STATUS)
    idle = {**STATUS, "phase": "idle", "checkpoint_id": None, "lease_expires_at": None}
    m2.EnvironmentStatus.model_validate(
        {**idle, "workers": 2, "expected_workers": 2, "session_aliases": 0, "session_placements": 0}
    )
    m2.ModelCommitReply.model_validate(MODEL_COMMIT)
    m2.CommitRequest.model_validate(COMMIT_REQUEST)
    m2.CommitRequest.model_validate({**COMMIT_REQUEST, "episode_ids": None})
    m2.ForgetReply.model_validate({"forgotten": ["a", "a", "b"]})  # real Gym: sorted, duplicates kept
    m2.ValidationRefusal.model_validate(
        {"detail": [{"type": "extra_forbidden", "loc": ["body", "x"], "msg": "Extra inputs", "input": 1}]}
    )


def test_the_multi_worker_fields_come_together() -> None:
    idle = {**STATUS, "phase": "idle", "checkpoint_id": None, "lease_expires_at": None}
    with pytest.raises(ValidationError, match="all of its worker fields"):
        m2.EnvironmentStatus.model_validate(
            {**idle, "workers": 2, "expected_workers": 2, "session_aliases": 0}
        )


def test_replies_are_judged_by_route_kind_and_code() -> None:
    assert check_reply_v2("commit", 200, MODEL_COMMIT, COMMIT_REQUEST, "model") is None
    problem = check_reply_v2("commit", 200, MODEL_COMMIT, COMMIT_REQUEST, "environment")
    assert problem is not None
    assert "staging_keys" in problem
    envelope = {"error": {"code": "invalid_phase", "detail": "not valid in phase idle"}}
    assert check_reply_v2("commit", 409, envelope, COMMIT_REQUEST, "model") is None
    assert check_reply_v2("commit", 422, envelope, COMMIT_REQUEST, "model") == (
        "422 reply of v2 commit: code invalid_phase goes with HTTP 409"
    )
    unknown = {"error": {"code": "not_a_policy_instance", "detail": "v1's code"}}
    assert check_reply_v2("prepare", 409, unknown, None, None) == (
        "409 reply of v2 prepare: unknown code 'not_a_policy_instance'"
    )
    v1_401 = {"detail": "missing or invalid bearer token"}
    problem = check_reply_v2("prepare", 401, v1_401, None, None)
    assert problem == "401 reply of v2 prepare is neither a reply, a refusal nor a validation error"
    nan = {"checkpoint_id": "c1", "deadline_ts": float("nan")}
    assert check_reply_v2("prepare", 500, None, nan, None) is None  # real Gym's 500
    assert check_reply_v2("prepare", 500, None, {"checkpoint_id": "c1", "deadline_ts": 1.0}, None) is not None


def test_coordinator_requests_are_judged_exactly() -> None:
    assert check_request_v2("commit", COMMIT_REQUEST, {}) is None
    problem = check_request_v2("resume", {"checkpoint_id": "c1", "deadline_ts": 1.0, "schema_version": 1}, {})
    assert problem is not None
    assert "schema_version: Extra inputs are not permitted" in problem
    assert check_request_v2("status", None, {"checkpoint_id": "c1"}) is not None  # a v1 habit


async def test_the_hook_turns_a_drifting_v2_reply_into_a_failure(
    oracle_v2: Violations, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = EnvironmentParticipant.status_extra

    def drifted(self: EnvironmentParticipant) -> dict[str, Any]:
        return {**extra(self), "accepting": True}  # an agent's field on an environment

    monkeypatch.setattr(EnvironmentParticipant, "status_extra", drifted)
    with start_cluster(default_v2_spec(), token=TOKEN) as running:
        async with httpx.AsyncClient() as http:
            reply = await http.get(
                running.urls["environment"] + "/ng-control/v1/checkpoint/status",
                headers={"authorization": f"Bearer {TOKEN}"},
            )
            assert reply.status_code == 200
    problems = oracle_v2.take()  # taken back: this test provoked them
    assert len(problems) == 1, problems
    assert "accepting: Extra inputs are not permitted" in problems[0]


async def test_the_hook_checks_what_the_coordinator_sends_to_v2_servers(
    oracle_v2: Violations, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEMO_GYM_CHECKPOINT_CONTROL_TOKEN", TOKEN)
    ledger_url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    with start_cluster(default_v2_spec(), token=TOKEN) as running:
        config = parse_config(running.config(ledger_url, tmp_path / "snapshots"), base_dir=tmp_path)
        async with Trainer(running.urls["environment"]) as trainer:
            await trainer.start(make_tasks(2, turns=3), paced=True)
            await trainer.advance(1)
            await trainer.wait_parked()
            requests, replies = oracle_v2.requests_checked, oracle_v2.replies_checked
            async with Coordinator.open(config) as coord:
                await coord.discover()
                await coord.checkpoint()
            await trainer.unpace()
            await trainer.wait_results()
    # prepare, commit and resume on each of the four participants, at least
    assert oracle_v2.requests_checked - requests >= 12
    assert oracle_v2.replies_checked - replies >= 12
    assert oracle_v2.take() == []
