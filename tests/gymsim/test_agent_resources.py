"""Agent (spec §4) and resources (spec §5) servers: every route, its 409s, the files it writes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator.protocol import (
    AGENT,
    AgentCommitReply,
    AgentPrepareReply,
    AgentStatusReply,
    ContinuationRow,
    ResourcesCommitReply,
    ResourcesStatusReply,
    agent_instance_dir,
    manifest_path,
    route,
    sha256_hex,
)
from quiesce.tools.gymsim import client as gc
from quiesce.tools.gymsim.cluster import start_cluster
from tests.gymsim.conftest import SPEC, TOKEN, Gym, auth, code, eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


def ok(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


async def step(gym: Gym, rollout_id: str, attempt: int = 0, text: str = "x") -> httpx.Response:
    return await gym.http.post(
        gym.urls["tools"] + "/tools/step",
        json={"input": text},
        headers={"x-nemo-gym-rollout-id": rollout_id, "x-nemo-gym-attempt-index": str(attempt)},
    )


async def prepare_agent(gym: Gym, checkpoint_id: str = "c1", *, give_up_s: float = 60.0) -> dict[str, Any]:
    """Prepare, retrying `agent_prepare_incomplete` (every 0.05 s, for at most `give_up_s`)."""
    until = asyncio.get_running_loop().time() + give_up_s
    while True:
        reply = await gym.op("simple_agent", "prepare", checkpoint_id)
        if code(reply) != "agent_prepare_incomplete" or asyncio.get_running_loop().time() > until:
            return ok(reply)
        await asyncio.sleep(0.05)


async def acknowledge(
    gym: Gym, executions: list[dict[str, Any]], token: str | None = TOKEN
) -> httpx.Response:
    return await gym.op("simple_agent", "acknowledge", body={"executions": executions}, token=token)


def ids(entries: list[Any]) -> list[tuple[str, int]]:
    return [(e["rollout_id"], e["attempt_index"]) for e in entries]


# -- agent ---------------------------------------------------------------------------------------


async def test_run_validation_and_rollout_views(gym: Gym) -> None:
    agent = gym.urls["simple_agent"]
    for bad in (
        {"rollout_id": "r 1", "turns": 2},
        {"rollout_id": "r1", "turns": 0},
        {"rollout_id": "r1"},
        {"rollout_id": "r1", "turns": 1, "x": 1},
    ):
        assert (await gym.http.post(agent + "/run", json=bad)).status_code == 422
    ok(await gym.http.post(agent + "/run", json={"rollout_id": "r1", "turns": 3}))
    again = await gym.http.post(agent + "/run", json={"rollout_id": "r1", "turns": 3})
    assert again.status_code == 409
    assert code(again) == "rollout_exists"
    rollouts = await gc.wait_finished(gym.http, agent, expect=1)
    view = rollouts["r1"]
    assert view["status"] == "completed"
    assert [e["turn"] for e in view["turn_log"]] == [1, 2, 3]
    assert view["last_committed_model_call_id"] == "call-3"
    assert view["resource_state_revisions"] == {"tools": 3}
    assert view["result"]["reward"] is not None
    assert (await gym.http.get(agent + "/rollouts/r1")).json()["status"] == "completed"
    assert (await gym.http.get(agent + "/rollouts/nope")).status_code == 404


async def test_prepare_incomplete_while_a_turn_cannot_finish_then_ready(gym: Gym) -> None:
    agent = gym.urls["simple_agent"]
    await gym.faults("policy_model", {"kind": "hang", "path": "/v1/responses", "rollout_id": "stuck"})
    await gc.start_rollout(gym.http, agent, "stuck", 2)

    async def in_flight() -> bool:
        return bool((await gym.admin("policy_model", "GET", "state"))["inflight_total"])

    await eventually(in_flight, what="the stuck model call")
    reply = await gym.op("simple_agent", "prepare", deadline_s=0.2)
    assert reply.status_code == 409
    assert code(reply) == "agent_prepare_incomplete"
    assert await gym.fence("simple_agent") == ("idle", None)  # fence back to idle
    status = AgentStatusReply.model_validate(ok(await gym.status("simple_agent")))
    assert status.running == 1
    assert ids(status.blocking_attempts) == [("stuck", 0)]
    assert status.blocking_attempts[0]["state"] == "park_requested"  # asked to park, still in its turn
    closed = await gym.http.post(agent + "/run", json={"rollout_id": "late", "turns": 1})
    assert closed.status_code == 409  # admission stays closed until resume
    assert code(closed) == "checkpoint_parked"
    await gym.admin("policy_model", "DELETE", "faults")
    prepared = AgentPrepareReply.model_validate(await prepare_agent(gym))
    assert prepared.ready_to_commit
    assert (prepared.running, prepared.parked, prepared.parked_with_boundary) == (0, 1, 1)
    assert await gym.fence("simple_agent") == ("prepared", "c1")
    assert ok(await gym.op("simple_agent", "resume"))["released"] == 1
    rollouts = await gc.wait_finished(gym.http, agent, expect=1)
    assert gc.turn_log_problems(rollouts) == []


async def test_model_refusal_leaves_the_rollout_parked_at_its_boundary(gym: Gym) -> None:
    agent = gym.urls["simple_agent"]
    ok(await gym.op("policy_model", "pause"))
    await gc.start_rollout(gym.http, agent, "r1", 3)

    async def blocked() -> bool:
        return bool((await gc.get_rollouts(gym.http, agent))["r1"]["status"] == "blocked")

    await eventually(blocked, what="the rollout blocked at the model gate")
    prepared = await prepare_agent(gym)
    assert (prepared["parked"], prepared["parked_with_boundary"], prepared["parked_without_boundary"]) == (
        1,
        1,
        0,
    )
    assert prepared["running"] == 0
    assert prepared["executions"][0]["state"] == "parked"
    assert prepared["executions"][0]["boundary_index"] == 0  # the turn it was refused re-runs from there
    ok(await gym.op("policy_model", "resume"))
    ok(await gym.op("simple_agent", "resume"))
    rollouts = await gc.wait_finished(gym.http, agent, expect=1)
    assert gc.turn_log_problems(rollouts) == []


async def test_agent_commit_files_and_continuation_rows(gym: Gym, tmp_path: Path) -> None:
    agent = gym.urls["simple_agent"]
    await gc.start_rollouts(gym.http, agent, {"b": 50, "a": 50, "c": 50})
    await gc.wait_turns(gym.http, agent, 2)
    prepared = await prepare_agent(gym)
    assert (prepared["running"], prepared["parked"], prepared["completed_unacknowledged"]) == (0, 3, 0)
    views = await gc.get_rollouts(gym.http, agent)
    commit = AgentCommitReply.model_validate(
        ok(await gym.op("simple_agent", "commit", checkpoint_dir=str(tmp_path)))
    )
    folder = tmp_path / agent_instance_dir("simple_agent")
    assert commit.manifest_digest == sha256_hex(
        (tmp_path / manifest_path("responses_api_agents", "simple_agent")).read_bytes()
    )
    index = commit.continuation_index
    assert index.relative_path == f"{agent_instance_dir('simple_agent')}/continuations.jsonl"
    data = (tmp_path / index.relative_path).read_bytes()
    assert (index.bytes, index.sha256, index.records, commit.records) == (len(data), sha256_hex(data), 3, 3)
    lines = data.decode().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["capture_key"] for r in rows] == ["a", "b", "c"]
    for line, row in zip(lines, rows, strict=True):
        assert line == json.dumps(row, separators=(",", ":"))  # compact
        assert list(row) == [
            "schema_version",
            "rollout_id",
            "attempt_index",
            "capture_key",
            "last_committed_model_call_id",
            "resource_state_revisions",
        ]
        ContinuationRow.model_validate(row)
        done = views[row["rollout_id"]]["turns_done"]  # parked at its boundary after `done` turns
        assert done >= 2
        assert row["last_committed_model_call_id"] == f"call-{done}"
        assert row["resource_state_revisions"] == {"tools": done}
    assert sorted(p.name for p in folder.iterdir()) == [  # real Gym's layout: one file per record
        "a.a0.json",
        "b.a0.json",
        "c.a0.json",
        "continuations.jsonl",
        "manifest.json",
    ]
    manifest = json.loads((folder / "manifest.json").read_bytes())
    assert manifest == {
        "schema_version": 1,
        "checkpoint_id": "c1",
        "instance_name": "simple_agent",
        "files": {f"{r}.a0.json": sha256_hex((folder / f"{r}.a0.json").read_bytes()) for r in "abc"},
        "continuation_index": index.model_dump(mode="json"),
    }
    for rid in "abc":
        record = json.loads((folder / f"{rid}.a0.json").read_bytes())
        assert (record["rollout_id"], record["attempt_index"]) == (rid, 0)
        assert record["turns_done"] == views[rid]["turns_done"]
    assert await gym.fence("simple_agent") == ("committed_paused", "c1")


async def test_a_finished_rollout_blocks_prepare_until_acknowledged(gym: Gym, tmp_path: Path) -> None:
    agent = gym.urls["simple_agent"]
    caps = await gym.caps("simple_agent")
    assert "completed_result_acknowledgement" in caps["features"]
    await gc.start_rollouts(gym.http, agent, {"done": 2, "long": 500})
    await gc.wait_until(gym.http, agent, lambda rs: rs["done"]["status"] == "completed")
    refused = await gym.op("simple_agent", "prepare", deadline_s=0.5)
    assert refused.status_code == 409
    assert code(refused) == "agent_prepare_incomplete"
    assert "completed_unacknowledged=1" in refused.json()["error"]["detail"]
    status = AgentStatusReply.model_validate(ok(await gym.status("simple_agent")))
    assert ids(status.completed_unacknowledged_attempts) == [("done", 0)]
    assert status.completed_unacknowledged_attempts[0]["state"] == "completed"
    # the whole batch is checked first: one unknown execution releases nothing
    bad = await acknowledge(
        gym, [{"rollout_id": "done", "attempt_index": 0}, {"rollout_id": "long", "attempt_index": 0}]
    )
    assert bad.status_code == 409
    assert code(bad) == "completed_execution_acknowledgement_error"
    assert "long" in bad.json()["error"]["detail"]
    assert AgentStatusReply.model_validate(ok(await gym.status("simple_agent"))).completed_unacknowledged == 1
    for invalid in (
        [],
        [{"rollout_id": "done", "attempt_index": 0}, {"rollout_id": "done", "attempt_index": 0}],
        [{"rollout_id": "-x", "attempt_index": 0}],
        [{"rollout_id": "done", "attempt_index": -1}],
        [{"rollout_id": "done", "attempt_index": 0, "extra": 1}],
    ):
        assert (await acknowledge(gym, invalid)).status_code == 422, invalid
    assert (
        await acknowledge(gym, [{"rollout_id": "done", "attempt_index": 0}], token=None)
    ).status_code == 401
    good = await acknowledge(gym, [{"rollout_id": "done", "attempt_index": 0}])
    assert ok(good) == {"acknowledged": [{"rollout_id": "done", "attempt_index": 0}]}
    assert ok(await acknowledge(gym, [{"rollout_id": "done", "attempt_index": 0}])) == ok(good)  # repeatable
    prepared = await prepare_agent(gym)
    assert prepared["ready_to_commit"]
    assert (prepared["completed_unacknowledged"], prepared["parked"]) == (0, 1)
    assert ids(prepared["executions"]) == [("long", 0)]
    commit = ok(await gym.op("simple_agent", "commit", checkpoint_dir=str(tmp_path)))
    assert commit["records"] == 1  # an acknowledged result is never part of a checkpoint
    views = await gc.get_rollouts(gym.http, agent)
    assert views["done"]["acknowledged"] is True
    assert views["done"]["result"] is not None  # its view stays readable
    ok(await gym.op("simple_agent", "resume"))


RECEIPT_SPEC: dict[str, Any] = {
    "servers": [
        {**server, "acknowledgement": "receipt"} if server["name"] == "simple_agent" else server
        for server in SPEC["servers"]
    ]
}


async def test_a_later_gym_agent_acknowledges_only_by_the_completion_receipt(tmp_path: Path) -> None:
    # later Gym: a held result is released only against its exact receipt, read from the status
    # entry or its own route; the anchor's bare pair is a 422, an altered receipt a 409
    with start_cluster(RECEIPT_SPEC, token=TOKEN) as running:
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            gym = Gym(running.urls, http)
            agent = gym.urls["simple_agent"]
            await gc.start_rollouts(http, agent, {"done": 2, "long": 500})
            await gc.wait_until(http, agent, lambda rs: rs["done"]["status"] == "completed")
            status = AgentStatusReply.model_validate(ok(await gym.status("simple_agent")))
            [held] = status.completed_unacknowledged_attempts
            receipt = held["completion_receipt"]
            path = gym.urls["simple_agent"] + route(AGENT, "receipt").full_path
            served = await http.get(path, params={"rollout_id": "done", "attempt_index": 0}, headers=auth())
            assert ok(served) == receipt
            views = await gc.get_rollouts(http, agent)
            assert receipt["result_digest"] == sha256_hex(
                json.dumps(views["done"]["result"], sort_keys=True, separators=(",", ":")).encode()
            )
            assert receipt["terminal_model_call_id"] == views["done"]["last_committed_model_call_id"]
            unheld = await http.get(path, params={"rollout_id": "long", "attempt_index": 0}, headers=auth())
            assert (unheld.status_code, code(unheld)) == (409, "completed_execution_acknowledgement_error")
            assert (
                await http.get(path, params={"rollout_id": "done", "attempt_index": 0})
            ).status_code == 401
            assert (await acknowledge(gym, [{"rollout_id": "done", "attempt_index": 0}])).status_code == 422
            altered = await acknowledge(gym, [{**receipt, "result_digest": "0" * 64}])
            assert (altered.status_code, code(altered)) == (409, "completed_execution_acknowledgement_error")
            assert (
                AgentStatusReply.model_validate(ok(await gym.status("simple_agent"))).completed_unacknowledged
                == 1
            )
            good = await acknowledge(gym, [receipt])
            assert ok(good) == {"acknowledged": [receipt]}
            assert ok(await acknowledge(gym, [receipt])) == ok(good)  # repeatable
            gone = await http.get(path, params={"rollout_id": "done", "attempt_index": 0}, headers=auth())
            assert code(gone) == "completed_execution_acknowledgement_error"  # released: no receipt kept
            prepared = await prepare_agent(gym)
            assert (prepared["ready_to_commit"], prepared["completed_unacknowledged"]) == (True, 0)
            ok(await gym.op("simple_agent", "resume"))


async def test_agent_phase_table(gym: Gym, tmp_path: Path) -> None:
    assert code(await gym.op("simple_agent", "commit", checkpoint_dir=str(tmp_path))) == "invalid_phase"
    assert ok(await gym.status("simple_agent"))["state"] == "accepting"  # status: any phase
    await prepare_agent(gym)
    assert code(await gym.op("simple_agent", "restore", checkpoint_dir=str(tmp_path))) == "invalid_phase"
    assert code(await gym.op("simple_agent", "prepare", "c2")) == "checkpoint_conflict"
    resumed = ok(await gym.op("simple_agent", "resume"))
    assert ok(await gym.op("simple_agent", "resume")) == resumed
    assert code(await gym.op("simple_agent", "prepare")) == "stale_checkpoint"
    # resume is allowed from idle (a rollback after agent_prepare_incomplete)
    assert ok(await gym.op("simple_agent", "resume", "c3"))["state"] == "accepting"


async def test_agent_restore_of_a_damaged_snapshot_fails_and_installs_nothing(
    gym: Gym, tmp_path: Path
) -> None:
    await gc.start_rollouts(gym.http, gym.urls["simple_agent"], {"r1": 100})
    await gc.wait_turns(gym.http, gym.urls["simple_agent"], 1)
    await prepare_agent(gym)
    assert ok(await gym.op("simple_agent", "commit", checkpoint_dir=str(tmp_path)))["records"] == 1
    record = tmp_path / agent_instance_dir("simple_agent") / "r1.a0.json"
    record.write_bytes(record.read_bytes() + b"\n")
    with start_cluster(SPEC, token=TOKEN) as fresh:
        target = Gym(fresh.urls, gym.http)
        reply = await target.op("simple_agent", "restore", "c2", checkpoint_dir=str(tmp_path))
        assert reply.status_code == 409
        assert code(reply) == "restore_failed"
        assert await target.fence("simple_agent") == ("idle", None)
        assert await gc.get_rollouts(gym.http, fresh.urls["simple_agent"]) == {}


async def test_stateless_agent_runs_without_taking_part(gym: Gym, tmp_path: Path) -> None:
    caps = await gym.caps("math_agent")
    assert caps["checkpoint_mode"] == "stateless"
    math = gym.urls["math_agent"]
    await gc.start_rollouts(gym.http, math, {"m1": 3})
    rollouts = await gc.wait_finished(gym.http, math, expect=1)
    assert rollouts["m1"]["result"]["reward"] is None  # no resources server
    prepared = ok(await gym.op("math_agent", "prepare"))
    assert (prepared["active"], prepared["completed_unacknowledged"]) == (0, 0)
    assert ok(await gym.op("math_agent", "commit", checkpoint_dir=str(tmp_path)))["records"] == 0
    ok(await gym.http.post(math + "/run", json={"rollout_id": "m2", "turns": 1}))  # never closed
    ok(await gym.op("math_agent", "resume"))


# -- resources -----------------------------------------------------------------------------------


async def test_mutations_count_revisions_per_session(gym: Gym) -> None:
    first = await step(gym, "r1")
    assert first.headers["x-nemo-gym-resource-state-revision"] == "1"
    assert first.json()["revision"] == 1
    assert (await step(gym, "r1")).headers["x-nemo-gym-resource-state-revision"] == "2"
    assert (await step(gym, "r1", attempt=1)).headers["x-nemo-gym-resource-state-revision"] == "1"
    other = await gym.http.post(gym.urls["tools"] + "/tools/step", json={"input": "x"})
    assert other.status_code == 400


async def test_prepare_closes_mutations_and_status_reports_locked_sessions(gym: Gym) -> None:
    await step(gym, "r1")
    assert code(await gym.status("tools")) == "invalid_phase"  # idle
    assert ok(await gym.op("tools", "prepare")) == {"sessions": 1, "state": "prepared"}
    closed = await step(gym, "r1")
    assert closed.status_code == 409
    assert closed.json()["error"]["code"] == "resources_admission_closed"
    assert "message" in closed.json()["error"]
    status = ResourcesStatusReply.model_validate(ok(await gym.status("tools")))
    # real Gym: `state` is the admission state, paused after prepare — not the fence phase
    assert (status.state, status.admission_state, status.sessions) == ("paused", "paused", 1)
    assert [(s.rollout_id, s.revision, s.locked) for s in status.per_session] == [("r1", 1, True)]
    assert code(await gym.status("tools", "c2")) == "checkpoint_conflict"
    assert ok(await gym.op("tools", "resume")) == {"state": "accepting"}
    assert (await step(gym, "r1")).status_code == 200
    assert code(await gym.status("tools")) == "stale_checkpoint"


async def test_lock_timeout_is_resources_checkpoint_error_and_admission_stays_closed(gym: Gym) -> None:
    """As Gym's participant: a failed prepare returns the fence to idle but leaves mutation
    admission closed; only a resume (allowed from idle) reopens it."""
    await step(gym, "r1")
    await gym.admin("tools", "POST", "options", json={"latency_s": 30})
    slow = asyncio.create_task(step(gym, "r1"))

    async def locked() -> bool:
        return bool((await gym.admin("tools", "GET", "state"))["locked_sessions"])

    await eventually(locked, what="a mutation holding the session lock")
    reply = await gym.op("tools", "prepare", deadline_s=0.3)
    assert reply.status_code == 409
    assert code(reply) == "resources_checkpoint_error"
    assert await gym.fence("tools") == ("idle", None)
    await gym.admin("tools", "POST", "options", json={"latency_s": 0})
    assert code(await step(gym, "r2")) == "resources_admission_closed"
    ok(await gym.op("tools", "resume"))
    assert (await step(gym, "r2")).status_code == 200  # the resume reopened admission
    slow.cancel()


async def test_resources_commit_restore_and_unsafe_restore(gym: Gym, tmp_path: Path) -> None:
    await step(gym, "r1")
    await step(gym, "r1")
    await step(gym, "r2")
    ok(await gym.op("tools", "prepare"))
    assert code(await gym.op("tools", "restore", checkpoint_dir=str(tmp_path))) == "invalid_phase"
    commit = ResourcesCommitReply.model_validate(
        ok(await gym.op("tools", "commit", checkpoint_dir=str(tmp_path)))
    )
    assert commit.sessions == 2
    folder = tmp_path / "resources" / "tools"
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "r1.a0.json", "r2.a0.json"]
    assert commit.manifest_digest == sha256_hex((folder / "manifest.json").read_bytes())
    ok(await gym.op("tools", "resume"))
    # this process served stateful traffic: restoring into it is unsafe
    unsafe = await gym.op("tools", "restore", "c2", checkpoint_dir=str(tmp_path))
    assert unsafe.status_code == 409
    assert code(unsafe) == "unsafe_resources_restore"
    with start_cluster(SPEC, token=TOKEN) as fresh:
        target = Gym(fresh.urls, gym.http)
        restored = ok(await target.op("tools", "restore", "c2", checkpoint_dir=str(tmp_path)))
        assert restored == {"sessions": 2, "source_checkpoint_id": "c1"}
        assert await target.fence("tools") == ("restored_paused", "c2")
        assert code(await step(target, "r1", attempt=1)) == "resources_admission_closed"
        ok(await target.op("tools", "resume", "c2"))
        continued = await step(target, "r1", attempt=1)
        assert continued.headers["x-nemo-gym-resource-state-revision"] == "3"  # attempt 1 continues attempt 0


async def test_resources_restore_verifies_digests(gym: Gym, tmp_path: Path) -> None:
    await step(gym, "r1")
    ok(await gym.op("tools", "prepare"))
    ok(await gym.op("tools", "commit", checkpoint_dir=str(tmp_path)))
    (tmp_path / "resources" / "tools" / "r1.a0.json").write_text('{"revision": 99}')
    with start_cluster(SPEC, token=TOKEN) as fresh:
        target = Gym(fresh.urls, gym.http)
        reply = await target.op("tools", "restore", "c2", checkpoint_dir=str(tmp_path))
        assert code(reply) == "restore_failed"
        assert await target.fence("tools") == ("idle", None)


async def test_verify_scores_with_the_judge(gym: Gym) -> None:
    await step(gym, "r1")
    url = gym.urls["tools"] + "/verify"
    first = ok(await gym.http.post(url, json={"rollout_id": "r1", "digest": "d"}))
    assert 0 <= first["reward"] < 1
    assert ok(await gym.http.post(url, json={"rollout_id": "r1", "digest": "d"})) == first
    assert (await gym.http.post(url, json={"rollout_id": "nope", "digest": "d"})).status_code == 404
    judge_calls = await gym.admin("judge", "GET", "state")
    assert judge_calls["ledger"] == {"r1": ["call-1", "call-2"]}
