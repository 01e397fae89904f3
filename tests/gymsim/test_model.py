"""Policy and auxiliary model servers (spec §3): admission, long-poll, ledger commit, restore."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator.protocol import (
    ModelCommitReply,
    ModelPauseReply,
    ModelRestoreReply,
    ModelResumeReply,
    ModelStatusReply,
    StorageReference,
    capture_key,
    manifest_path,
    sha256_hex,
)
from quiesce.tools.gymsim.common import jsonl_bytes
from tests.gymsim.conftest import Gym, code, eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def call(
    gym: Gym, rollout_id: str | None, turn: int, attempt: int = 0, name: str = "policy_model"
) -> httpx.Response:
    headers = (
        {}
        if rollout_id is None
        else {"x-nemo-gym-rollout-id": rollout_id, "x-nemo-gym-attempt-index": str(attempt)}
    )
    return await gym.http.post(
        gym.urls[name] + "/v1/responses",
        json={"model": name, "input": f"turn {turn}", "metadata": {"turn": turn}},
        headers=headers,
    )


def write_index(folder: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    data, count = jsonl_bytes(rows)
    (folder / "agent").mkdir(parents=True, exist_ok=True)
    (folder / "agent" / "continuations.jsonl").write_bytes(data)
    return {
        "relative_path": "agent/continuations.jsonl",
        "sha256": sha256_hex(data),
        "records": count,
        "bytes": len(data),
    }


def row(rollout_id: str, last: str | None, attempt: int = 0) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "rollout_id": rollout_id,
        "attempt_index": attempt,
        "capture_key": capture_key(rollout_id, attempt),
        "last_committed_model_call_id": last,
        "resource_state_revisions": {},
    }


async def pause_until_prepared(gym: Gym, checkpoint_id: str = "c1") -> None:
    reply = await gym.op("policy_model", "pause", checkpoint_id)
    assert reply.status_code == 200, reply.text
    status = await gym.status("policy_model", checkpoint_id, timeout_s=30, wait_state="paused")
    assert status.json()["state"] == "paused"
    assert await gym.fence("policy_model") == ("prepared", checkpoint_id)


async def test_output_is_deterministic_and_calls_are_numbered_per_capture_key(gym: Gym) -> None:
    first = await call(gym, "r1", 1)
    assert first.status_code == 200
    assert first.json()["metadata"]["model_call_id"] == "call-1"
    assert first.headers["x-nemo-gym-model-call-id"] == "call-1"
    second = await call(gym, "r1", 1)
    assert second.json()["metadata"]["model_call_id"] == "call-2"
    assert second.json()["output_text"] == first.json()["output_text"]
    other_attempt = await call(gym, "r1", 1, attempt=2)
    assert other_attempt.json()["metadata"] == {
        "model_call_id": "call-1",
        "capture_key": "r1-a2",
        "attempt_index": 2,
    }
    assert other_attempt.json()["output_text"] == first.json()["output_text"]  # not a function of the attempt
    assert (await call(gym, "r1", 2)).json()["output_text"] != first.json()["output_text"]
    anonymous = await call(gym, None, 1)
    assert anonymous.status_code == 200
    assert anonymous.json()["metadata"]["model_call_id"] is None
    for suffix in ("/v1/chat/completions", "/v1/messages"):
        assert (
            await gym.http.post(gym.urls["policy_model"] + suffix, json={"messages": []})
        ).status_code == 200


async def test_pause_gate_status_and_resume(gym: Gym) -> None:
    reply = await gym.op("policy_model", "pause")
    assert reply.status_code == 200
    paused = ModelPauseReply.model_validate(reply.json())
    assert paused.state == "paused"
    assert paused.inflight_total == 0
    assert paused.workers.acknowledged == paused.workers.expected == 1
    assert await gym.fence("policy_model") == ("prepared", "c1")
    refused = await call(gym, "r1", 1)
    assert refused.status_code == 409
    assert code(refused) == "checkpoint_parked"
    assert refused.headers["retry-after"] == "1"
    status = await gym.status("policy_model", timeout_s=0)
    assert status.status_code == 200
    parsed = ModelStatusReply.model_validate(status.json())
    assert (parsed.checkpoint_id, parsed.state, parsed.inflight_total) == ("c1", "paused", 0)
    assert parsed.per_worker["0"].state == "paused"
    reply = await gym.op("policy_model", "resume")
    assert reply.status_code == 200
    assert ModelResumeReply.model_validate(reply.json()).state == "accepting"
    assert await gym.fence("policy_model") == ("idle", None)
    assert (await call(gym, "r1", 1)).status_code == 200


async def test_pause_while_in_flight_drains_and_status_moves_to_prepared(gym: Gym) -> None:
    await gym.faults("policy_model", {"kind": "hang", "path": "/v1/responses"})
    client = httpx.AsyncClient(trust_env=False, timeout=60)
    import asyncio

    pending = asyncio.create_task(
        client.post(
            gym.urls["policy_model"] + "/v1/responses",
            json={"input": "x"},
            headers={"x-nemo-gym-rollout-id": "held"},
        )
    )

    async def held() -> bool:
        return bool((await gym.admin("policy_model", "GET", "state"))["inflight_total"])

    await eventually(held, what="the held call is in flight")
    paused = (await gym.op("policy_model", "pause")).json()
    assert (paused["state"], paused["inflight_total"]) == ("draining", 1)
    assert await gym.fence("policy_model") == ("preparing", "c1")
    status = (await gym.status("policy_model", timeout_s=0.05, wait_state="paused")).json()
    assert status["state"] == "draining"
    assert status["inflight_total"] == 1
    assert status["inflight"][0]["rollout_id"] == "held"
    assert await gym.fence("policy_model") == ("preparing", "c1")
    assert code(await gym.op("policy_model", "commit", checkpoint_dir="/tmp/never")) == "invalid_phase"
    await gym.admin("policy_model", "DELETE", "faults")  # the held call completes
    assert (await pending).status_code == 200
    await client.aclose()
    status = (await gym.status("policy_model", timeout_s=30, wait_state="paused")).json()
    assert (status["state"], status["inflight_total"]) == ("paused", 0)
    assert await gym.fence("policy_model") == ("prepared", "c1")


async def test_status_phase_rules(gym: Gym) -> None:
    assert code(await gym.status("policy_model")) == "invalid_phase"  # idle
    await gym.op("policy_model", "pause")
    assert code(await gym.status("policy_model", "other")) == "checkpoint_conflict"
    await gym.op("policy_model", "resume")
    assert code(await gym.status("policy_model")) == "stale_checkpoint"


async def test_commit_writes_the_ledger_up_to_each_last_committed_call(gym: Gym, tmp_path: Path) -> None:
    for turn in (1, 2, 3):
        await call(gym, "r1", turn)
    await call(gym, "r2", 1)
    await call(gym, "r2", 1, attempt=1)
    await call(gym, "stray", 1)
    await pause_until_prepared(gym)
    index = write_index(tmp_path, [row("r1", "call-2"), row("r2", "call-1", attempt=1), row("r3", None)])
    reply = await gym.op("policy_model", "commit", checkpoint_dir=str(tmp_path), continuation_indexes=[index])
    assert reply.status_code == 200, reply.text
    assert set(reply.json()) == {
        "rollouts",
        "rows",
        "excluded_tombstoned",
        "excluded_inactive",
        "manifest_digest",
        "storage_reference_index",
    }
    commit = ModelCommitReply.model_validate(reply.json())
    assert (commit.rollouts, commit.rows) == (3, 3)
    assert commit.excluded_inactive == 2  # r2 (attempt 0) and stray have no continuation row
    folder = tmp_path / "model-ledger/policy_model"
    manifest_file = tmp_path / manifest_path("responses_api_models", "policy_model")
    assert commit.manifest_digest == sha256_hex(manifest_file.read_bytes())
    # Gym's layout: one lineage file per capture key (none for a root without calls), the index, the manifest
    assert sorted(p.name for p in folder.iterdir()) == [
        "manifest.json",
        "r1.lineage.jsonl",
        "r2-a1.lineage.jsonl",
        "storage-references.jsonl",
    ]
    manifest = json.loads(manifest_file.read_bytes())
    assert (manifest["schema_version"], manifest["checkpoint_id"], manifest["server_name"]) == (
        2,
        "c1",
        "policy_model",
    )
    assert sorted(manifest["rollouts"]) == ["r1", "r2-a1", "r3"]
    lineage = (folder / "r1.lineage.jsonl").read_bytes()
    assert manifest["rollouts"]["r1"] == {
        "files": {"r1.lineage.jsonl": sha256_hex(lineage)},
        "rows": 2,
        "bytes": len(lineage),
    }
    assert manifest["rollouts"]["r3"] == {"files": {}, "rows": 0, "bytes": 0}
    assert [json.loads(line)["call_id"] for line in lineage.splitlines()] == ["call-1", "call-2"]
    ref = commit.storage_reference_index
    assert ref is not None
    assert manifest["storage_reference_index"] == ref.model_dump(mode="json")
    assert ref.relative_path == "model-ledger/policy_model/storage-references.jsonl"
    data = (tmp_path / ref.relative_path).read_bytes()
    assert (ref.sha256, ref.bytes, ref.records) == (sha256_hex(data), len(data), len(data.splitlines()))
    references = [StorageReference.model_validate_json(line) for line in data.splitlines()]
    # each root's boundary call needs its own staging row and every row before it in its capture key
    assert [(r.capture_key, r.boundary_model_call_id, r.key) for r in references] == [
        ("r1", "call-2", "r1/call-1"),
        ("r1", "call-2", "r1/call-2"),
        ("r2-a1", "call-1", "r2-a1/call-1"),
    ]
    assert data == b"".join(
        json.dumps(r.model_dump(mode="json"), separators=(",", ":")).encode() + b"\n" for r in references
    )  # compact, sorted by key
    assert await gym.fence("policy_model") == ("committed_paused", "c1")
    # idempotent replay returns the recorded reply unchanged
    again = await gym.op("policy_model", "commit", checkpoint_dir="/elsewhere", continuation_indexes=[])
    assert again.json() == reply.json()


@pytest.mark.parametrize("damage", ["sha256", "bytes", "records", "missing", "unknown_call", "bad_call_id"])
async def test_commit_with_a_bad_index_is_ledger_mismatch(gym: Gym, tmp_path: Path, damage: str) -> None:
    await call(gym, "r1", 1)
    await pause_until_prepared(gym)
    rows = [row("r1", {"unknown_call": "call-9", "bad_call_id": "x-1"}.get(damage, "call-1"))]
    index = write_index(tmp_path, rows)
    if damage == "sha256":
        index["sha256"] = "0" * 64
    elif damage == "bytes":
        index["bytes"] += 1
    elif damage == "records":
        index["records"] = 2
    elif damage == "missing":
        index["relative_path"] = "agent/nothing.jsonl"
    reply = await gym.op("policy_model", "commit", checkpoint_dir=str(tmp_path), continuation_indexes=[index])
    assert reply.status_code == 409
    assert code(reply) == "ledger_mismatch"
    assert await gym.fence("policy_model") == ("prepared", "c1")  # failure: back where it was
    assert not (tmp_path / "model-ledger").exists()


async def test_commit_fails_on_the_first_bad_index_in_order(gym: Gym, tmp_path: Path) -> None:
    await call(gym, "r1", 1)
    await pause_until_prepared(gym)
    unknown_call = write_index(tmp_path, [row("r1", "call-9")])
    missing = {**unknown_call, "relative_path": "agent/nothing.jsonl"}
    for indexes, named in (([unknown_call, missing], "call-9"), ([missing, unknown_call], "nothing.jsonl")):
        reply = await gym.op(
            "policy_model", "commit", checkpoint_dir=str(tmp_path), continuation_indexes=indexes
        )
        assert reply.status_code == 409
        assert code(reply) == "ledger_mismatch"
        assert named in reply.json()["error"]["detail"]
        assert await gym.fence("policy_model") == ("prepared", "c1")


async def committed_model(gym: Gym, folder: Path) -> dict[str, Any]:
    for turn in (1, 2, 3):
        await call(gym, "r1", turn)
    await pause_until_prepared(gym, "src")
    index = write_index(folder, [row("r1", "call-2")])
    reply = await gym.op(
        "policy_model", "commit", "src", checkpoint_dir=str(folder), continuation_indexes=[index]
    )
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


async def test_restore_installs_attempt_n_plus_one_and_boots_paused(cluster: Any, tmp_path: Path) -> None:
    from quiesce.tools.gymsim.cluster import start_cluster
    from tests.gymsim.conftest import SPEC, TOKEN

    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        with start_cluster(SPEC, token=TOKEN) as source:
            await committed_model(Gym(source.urls, http), tmp_path)
        gym = Gym(cluster.urls, http)
        reply = await gym.op("policy_model", "restore", "c2", checkpoint_dir=str(tmp_path))
        assert reply.status_code == 200, reply.text
        restored = ModelRestoreReply.model_validate(reply.json())
        assert (restored.rollouts, restored.rows, restored.checkpoint_id) == (1, 2, "src")
        assert await gym.fence("policy_model") == ("restored_paused", "c2")
        assert code(await call(gym, "r1", 3, attempt=1)) == "checkpoint_parked"
        assert (await gym.admin("policy_model", "GET", "state"))["admission_state"] == "paused"
        assert (await gym.op("policy_model", "resume", "c2")).status_code == 200
        continued = await call(gym, "r1", 3, attempt=1)
        assert continued.json()["metadata"]["model_call_id"] == "call-3"  # ids continue


async def test_restore_verifies_digests_before_installing(cluster: Any, gym: Gym, tmp_path: Path) -> None:
    await committed_model(gym, tmp_path)
    await gym.op("policy_model", "resume", "src")
    calls_file = tmp_path / "model-ledger/policy_model/r1.lineage.jsonl"
    good = calls_file.read_bytes()
    calls_file.write_bytes(good.replace(b"call-1", b"call-7"))
    from quiesce.tools.gymsim.cluster import start_cluster
    from tests.gymsim.conftest import SPEC, TOKEN

    with start_cluster(SPEC, token=TOKEN) as fresh:
        target = Gym(fresh.urls, gym.http)
        reply = await target.op("policy_model", "restore", "c2", checkpoint_dir=str(tmp_path))
        assert reply.status_code == 409
        assert code(reply) == "restore_failed"
        assert await target.fence("policy_model") == ("restore_failed_paused", "c2")
        state = await target.admin("policy_model", "GET", "state")
        assert state["ledger"] == {}
        assert state["admission_state"] == "paused"
        assert (
            code(await target.op("policy_model", "restore", "c3", checkpoint_dir=str(tmp_path)))
            == "checkpoint_conflict"
        )
        calls_file.write_bytes(good)
        reply = await target.op("policy_model", "restore", "c2", checkpoint_dir=str(tmp_path))
        assert reply.status_code == 200, reply.text
        assert await target.fence("policy_model") == ("restored_paused", "c2")


async def test_restore_without_a_snapshot_fails_into_restore_failed_paused(gym: Gym, tmp_path: Path) -> None:
    reply = await gym.op("policy_model", "restore", checkpoint_dir=str(tmp_path / "nothing"))
    assert reply.status_code == 409
    assert code(reply) == "restore_failed"
    assert await gym.fence("policy_model") == ("restore_failed_paused", "c1")
    assert (await gym.op("policy_model", "resume")).status_code == 200
    assert await gym.fence("policy_model") == ("idle", None)
    assert (await call(gym, "r1", 1)).status_code == 200


async def test_phase_table_of_the_model(gym: Gym, tmp_path: Path) -> None:
    assert code(await gym.op("policy_model", "commit", checkpoint_dir=str(tmp_path))) == "invalid_phase"
    assert code(await gym.op("policy_model", "resume")) == "invalid_phase"  # resume not allowed from idle
    assert (await gym.op("policy_model", "pause")).status_code == 200
    assert code(await gym.op("policy_model", "pause", "c2")) == "checkpoint_conflict"
    assert code(await gym.op("policy_model", "restore", checkpoint_dir=str(tmp_path))) == "invalid_phase"
    resumed = await gym.op("policy_model", "resume")
    assert (await gym.op("policy_model", "resume")).json() == resumed.json()  # repeated resume replays
    assert code(await gym.op("policy_model", "pause")) == "stale_checkpoint"


async def test_auxiliary_judge_refuses_control_but_never_gates(gym: Gym, tmp_path: Path) -> None:
    for operation in ("pause", "commit", "restore", "resume"):
        extra: dict[str, Any] = (
            {"checkpoint_dir": str(tmp_path)} if operation in ("commit", "restore") else {}
        )
        reply = await gym.op("judge", operation, **extra)
        assert reply.status_code == 409, operation
        assert code(reply) == "not_a_policy_instance"
    status = await gym.status("judge")
    assert status.status_code == 200
    assert status.json()["state"] == "accepting"
    assert (await gym.op("policy_model", "pause")).status_code == 200
    assert (await call(gym, "r1", 1, name="judge")).status_code == 200
    assert await gym.fence("judge") == ("idle", None)


async def test_commit_with_another_deployments_index_is_ledger_mismatch(gym: Gym, tmp_path: Path) -> None:
    # a replica's model served only its own deployment's rollouts: a continuation row of a rollout
    # it never served (another deployment's agent's index) is refused, as Gym refuses it
    await call(gym, "a0", 1)
    await pause_until_prepared(gym)
    index = write_index(tmp_path, [row("a0", "call-1"), row("b0", "call-1")])
    reply = await gym.op("policy_model", "commit", checkpoint_dir=str(tmp_path), continuation_indexes=[index])
    assert reply.status_code == 409
    assert code(reply) == "ledger_mismatch"
    assert "b0" in reply.json()["error"]["detail"]
    assert await gym.fence("policy_model") == ("prepared", "c1")
    assert not (tmp_path / "model-ledger").exists()
