"""The policy model as real Gym runs it: anonymous in-flight calls (`plane: null`), the restored
storage reference index (the anchor's opt-in and later Gym's always), Gym's multi-worker
coordinator shapes, and models that pause but export nothing (drain-only, restart_only)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator.protocol import ModelRestoreReply, ModelStatusReply
from quiesce.tools.gymsim.cluster import start_cluster
from tests.gymsim.conftest import TOKEN, Gym, code, eventually
from tests.gymsim.test_model import call, pause_until_prepared, row, write_index

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


def spec(**model: Any) -> dict[str, Any]:
    return {"servers": [{"kind": "model", "name": "policy_model", **model}]}


async def committed(gym: Gym, folder: Path) -> dict[str, Any]:
    for turn in (1, 2):
        await call(gym, "r1", turn)
    await pause_until_prepared(gym, "src")
    index = write_index(folder, [row("r1", "call-2")])
    reply = await gym.op(
        "policy_model", "commit", "src", checkpoint_dir=str(folder), continuation_indexes=[index]
    )
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


async def test_in_flight_calls_without_identity_headers_report_nulls(gym: Gym) -> None:
    await gym.faults("policy_model", {"kind": "hang", "path": "/v1/responses"})
    anonymous = asyncio.create_task(call(gym, None, 1))
    planed = asyncio.create_task(
        gym.http.post(
            gym.urls["policy_model"] + "/v1/responses",
            json={"input": "x"},
            headers={
                "x-nemo-gym-rollout-id": "r9",
                "x-nemo-gym-attempt-index": "2",
                "x-nemo-gym-plane": "rollout",
            },
        )
    )

    async def two() -> bool:
        return bool((await gym.admin("policy_model", "GET", "state"))["inflight_total"] == 2)

    await eventually(two, what="two calls in flight")
    assert (await gym.op("policy_model", "pause")).status_code == 200
    reply = await gym.status("policy_model", timeout_s=0, wait_state="paused")
    status = reply.json()
    assert set(status) == {
        "checkpoint_id",
        "state",
        "per_worker",
        "inflight_total",
        "waiters_total",
        "inflight",
        "tombstones",
    }
    entries = sorted(status["inflight"], key=lambda e: e["plane"] or "")
    assert [(e["rollout_id"], e["attempt_index"], e["plane"]) for e in entries] == [
        (None, None, None),  # no headers: real Gym reports nulls
        ("r9", 2, "rollout"),
    ]
    assert (
        ModelStatusReply.model_validate(status).not_drained() == "state draining; 2 requests still in flight"
    )
    await gym.admin("policy_model", "DELETE", "faults")
    await asyncio.gather(anonymous, planed)
    drained = ModelStatusReply.model_validate(
        (await gym.status("policy_model", timeout_s=30, wait_state="paused")).json()
    )
    assert drained.not_drained() is None
    assert (await gym.op("policy_model", "resume")).status_code == 200


async def test_restore_returns_the_index_only_when_asked_at_the_anchor(tmp_path: Path) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        with start_cluster(spec(), token=TOKEN) as source:
            commit = await committed(Gym(source.urls, http), tmp_path)
        for flag, expected in ((None, None), (False, None), (True, commit["storage_reference_index"])):
            with start_cluster(spec(), token=TOKEN) as fresh:
                gym = Gym(fresh.urls, http)
                extra: dict[str, Any] = {} if flag is None else {"include_storage_reference_index": flag}
                reply = await gym.op("policy_model", "restore", "c2", checkpoint_dir=str(tmp_path), **extra)
                assert reply.status_code == 200, reply.text
                body = reply.json()
                assert body.get("storage_reference_index") == expected
                assert set(body) - {"storage_reference_index"} == {
                    "rollouts",
                    "rows",
                    "checkpoint_id",
                    "tombstones",
                    "source_attempts",
                }
                assert body["source_attempts"] == [{"rollout_id": "r1", "attempt_index": 0}]
                assert ModelRestoreReply.model_validate(body).checkpoint_id == "src"


async def test_later_gym_always_returns_the_index_and_refuses_the_flag(tmp_path: Path) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        with start_cluster(spec(restore_index="always"), token=TOKEN) as source:
            commit = await committed(Gym(source.urls, http), tmp_path)
        with start_cluster(spec(restore_index="always"), token=TOKEN) as fresh:
            gym = Gym(fresh.urls, http)
            flagged = await gym.op(
                "policy_model",
                "restore",
                "c2",
                checkpoint_dir=str(tmp_path),
                include_storage_reference_index=True,
            )
            assert flagged.status_code == 422
            assert "include_storage_reference_index" in flagged.text
            assert await gym.fence("policy_model") == ("idle", None)  # a 422 ran nothing
            reply = await gym.op("policy_model", "restore", "c2", checkpoint_dir=str(tmp_path))
            assert reply.status_code == 200, reply.text
            assert reply.json()["storage_reference_index"] == commit["storage_reference_index"]


async def test_restore_refuses_a_storage_index_that_does_not_match_its_file(tmp_path: Path) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        with start_cluster(spec(), token=TOKEN) as source:
            commit = await committed(Gym(source.urls, http), tmp_path)
        index = tmp_path / commit["storage_reference_index"]["relative_path"]
        index.write_bytes(index.read_bytes() + b'{"extra": 1}\n')
        with start_cluster(spec(), token=TOKEN) as fresh:
            gym = Gym(fresh.urls, http)
            reply = await gym.op("policy_model", "restore", "c2", checkpoint_dir=str(tmp_path))
            assert reply.status_code == 409
            assert code(reply) == "restore_failed"
            assert "storage-references.jsonl" in reply.json()["error"]["detail"]
            assert (await gym.admin("policy_model", "GET", "state"))["ledger"] == {}


async def test_coordinator_mode_reports_gyms_multi_worker_shapes(tmp_path: Path) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        with start_cluster(spec(workers=2, worker_mode="coordinator"), token=TOKEN) as running:
            gym = Gym(running.urls, http)
            caps = await gym.caps("policy_model")
            assert caps["multi_process"] == {"mode": "coordinator", "num_workers": 2}
            await gym.faults("policy_model", {"kind": "hang", "path": "/v1/responses"})
            pending = [asyncio.create_task(call(gym, f"r{i}", 1)) for i in range(3)]

            async def held() -> bool:
                return bool((await gym.admin("policy_model", "GET", "state"))["inflight_total"] == 3)

            await eventually(held, what="three calls in flight")
            paused = await gym.op("policy_model", "pause")
            assert paused.json() == {
                "state": "draining",
                "workers": {"acknowledged": 2, "expected": 2},
                "inflight_total": 3,
                "waiters_total": 0,
            }
            status = (await gym.status("policy_model", timeout_s=0, wait_state="paused")).json()
            assert set(status) == {
                "state",
                "workers",
                "missing_workers",
                "inflight_total",
                "waiters_total",
                "per_worker",
            }  # no checkpoint_id, no per-worker state
            assert status["workers"] == {"acknowledged": 2, "expected": 2, "live": 2}
            assert status["missing_workers"] == 0
            assert sorted(status["per_worker"]) == ["0", "1"]
            assert [sorted(w) for w in status["per_worker"].values()] == [
                ["acked_seq", "connected", "inflight"]
            ] * 2
            assert sum(w["inflight"] for w in status["per_worker"].values()) == 3
            assert (
                ModelStatusReply.model_validate(status).not_drained()
                == "state draining; 3 requests still in flight"
            )
            await gym.admin("policy_model", "DELETE", "faults")
            await asyncio.gather(*pending)
            drained = (await gym.status("policy_model", timeout_s=30, wait_state="paused")).json()
            assert (drained["state"], drained["inflight_total"], drained["workers"]["acknowledged"]) == (
                "paused",
                0,
                2,
            )
            assert ModelStatusReply.model_validate(drained).not_drained() is None
            assert await gym.fence("policy_model") == ("prepared", "c1")
            # a worker lost mid-checkpoint: the coordinator may not report the pool drained
            await gym.admin("policy_model", "POST", "workers", json={"connected": 1})
            lost = ModelStatusReply.model_validate((await gym.status("policy_model", timeout_s=0)).json())
            assert (lost.state, lost.missing_workers) == ("draining", 1)
            assert lost.not_drained() == "state draining; 1 of 2 workers missing; 1 of 2 workers acknowledged"
            resumed = await gym.op("policy_model", "resume")
            assert resumed.json() == {
                "state": "accepting",
                "workers": {"acknowledged": 1, "expected": 2},
                "released_waiters": 0,
            }
            # membership is incomplete: a pause refuses rather than report a partial pool
            refused = await gym.op("policy_model", "pause", "c2")
            assert refused.status_code == 409
            assert code(refused) == "missing_workers"
            assert "missing: 1" in refused.json()["error"]["detail"]
            assert await gym.fence("policy_model") == ("idle", None)
            await gym.admin("policy_model", "POST", "workers", json={"connected": 2})
            assert (await gym.op("policy_model", "pause", "c3")).status_code == 200


@pytest.mark.parametrize("mode", ["stateless", "restart_only"])
async def test_a_model_that_exports_nothing_pauses_but_refuses_commit_and_restore(
    mode: str, tmp_path: Path
) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        with start_cluster(spec(checkpoint_mode=mode), token=TOKEN) as running:
            gym = Gym(running.urls, http)
            caps = await gym.caps("policy_model")
            assert (caps["checkpoint_mode"], caps["instance_role"]) == (mode, "policy")
            assert "external_storage_reference_index_v1" not in caps["features"]
            await pause_until_prepared(gym)
            commit = await gym.op(
                "policy_model", "commit", checkpoint_dir=str(tmp_path), continuation_indexes=[]
            )
            assert code(commit) == "ledger_not_checkpointable"
            assert not (tmp_path / "model-ledger").exists()
            assert (await gym.op("policy_model", "resume")).status_code == 200
            restore = await gym.op("policy_model", "restore", "c2", checkpoint_dir=str(tmp_path))
            assert code(restore) == "ledger_not_checkpointable"
            assert json.loads((await gym.op("policy_model", "resume", "c2")).text)["state"] == "accepting"


async def test_a_generation_cut_pauses_at_once_and_holds_the_response_until_resume(gym: Gym) -> None:
    # the anchor's shapes carry none of later Gym's counters
    anchor = (await gym.op("policy_model", "pause", "c0")).json()
    assert set(anchor) == {"state", "workers", "inflight_total", "waiters_total"}
    assert (await gym.op("policy_model", "resume", "c0")).status_code == 200
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        with start_cluster(spec(generation_cut=True, latency_s=0.2), token=TOKEN) as running:
            cut = Gym(running.urls, http)
            pending = asyncio.create_task(call(cut, "r1", 1))

            async def in_flight() -> bool:
                return bool((await cut.admin("policy_model", "GET", "state"))["inflight_total"])

            await eventually(in_flight, what="the call is in flight")
            paused = (await cut.op("policy_model", "pause")).json()
            assert (paused["state"], paused["inflight_total"], paused["generation_pending_total"]) == (
                "paused",
                1,
                0,
            )
            assert paused["generation_cut_proof"]["prefixes"]
            assert await cut.fence("policy_model") == ("prepared", "c1")  # prepare-safe at once
            status = ModelStatusReply.model_validate(
                (await cut.status("policy_model", timeout_s=0, wait_state="paused")).json()
            )
            assert status.held_by_cut()
            await asyncio.sleep(1.0)  # five times the call's latency: generated, but held
            assert not pending.done()
            assert (await cut.op("policy_model", "resume")).status_code == 200
            assert (await pending).status_code == 200  # released by the resume
            after = await cut.admin("policy_model", "GET", "state")
            assert (after["admission_state"], after["inflight_total"]) == ("accepting", 0)
