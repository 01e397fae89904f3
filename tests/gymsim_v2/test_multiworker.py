"""Multi-worker coordinator mode (Gym's `_checkpoint/participant_workers.py`) of the environment:
one phase machine over worker tables; merged report; one records file; restored records claimed
by whichever worker runs the replacement. Status and manifest carry Gym's coordinator extras in
Gym's shapes (counts and sorted lists), which the oracle's strict models accept."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from quiesce.coordinator.protocol_v2 import EpisodeId
from quiesce.tools.gymsim.v2.environment import Episode
from quiesce.tools.gymsim.v2.trainer import expected_results, make_tasks
from quiesce.tools.gymsim.v2.workers import CoordinatedEnvironment
from tests.gymsim_v2.conftest import V2, running, v2_spec
from tests.oracle import models_v2 as m2

pytestmark = pytest.mark.anyio

SPEC = v2_spec(environment={"workers": 2, "worker_mode": "coordinator"})


async def test_two_workers_checkpoint_and_restore_exactly(http: httpx.AsyncClient, tmp_path: Path) -> None:
    tasks = make_tasks(4, turns=4)
    with running(SPEC) as first:
        gym = V2(first.urls, http)
        trainer = gym.trainer()
        await trainer.start(tasks, paced=True)
        live = await trainer.episodes()
        assert sorted(e["worker"] for e in live.values()) == [0, 0, 1, 1]  # least-loaded placement
        await trainer.hold(["r0", "r1"])
        await trainer.advance(1)
        await trainer.wait_mid_turn(["r0", "r1"])
        status = await gym.state("environment")
        m2.EnvironmentStatus.model_validate(status)
        assert {
            k: status[k] for k in ("workers", "expected_workers", "session_aliases", "session_placements")
        } == {
            "workers": 2,
            "expected_workers": 2,
            "session_aliases": 0,  # an environment's records are claimed, never routed by owner
            "session_placements": 0,
        }
        assert status["restored_pending"] == []
        tables = (await gym.admin("environment", "GET", "state"))["worker_reports"]
        assert [w["episodes"] for w in tables] == [2, 2]
        not_ready = (await gym.op("environment", "prepare", "c1", deadline_s=0.3)).json()
        assert not_ready["phase"] == "preparing"
        held_workers = {live[k]["worker"] for k in ("r0", "r1")}
        assert not_ready["report"]["blockers"] == ["r0", "r1"]  # union over the workers
        assert not_ready["report"]["counts"] == {"episodes": 4, "workers": 2}  # summed, plus `workers`
        tables = (await gym.admin("environment", "GET", "state"))["worker_reports"]
        assert {w["worker"] for w in tables if not w["report"]["ready"]} == held_workers
        assert all(w["closed"] for w in tables)
        m2.EnvironmentStatus.model_validate(await gym.state("environment"))
        await gym.op("environment", "resume", "c1")
        await trainer.release()
        await trainer.wait_parked()
        commits = await gym.control.checkpoint("c2", str(tmp_path), trainer.in_flight(), stop=True)
        await trainer.detach()
    folder = tmp_path / "gym/environment/environment"
    manifest = json.loads((folder / "manifest.json").read_bytes())
    assert manifest == commits["environment"]["manifest"]
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("records")) == [
        manifest["records_file"]
    ]
    m2.Manifest.model_validate(manifest)
    assert (manifest["session_owners"], manifest["placed_sessions"]) == ([], [])
    records = [json.loads(line) for line in (folder / manifest["records_file"]).read_bytes().splitlines()]
    assert sorted(r["episode_id"]["rollout_id"] for r in records) == sorted(tasks)
    assert all(set(r) == {"episode_id", "task_digest", "boundary"} for r in records)  # Gym's EpisodeRecord
    with running(SPEC) as second:
        gym = V2(second.urls, http)
        await gym.control.restore_all("r1", str(tmp_path), trainer.in_flight())
        restored = await gym.state("environment")
        m2.EnvironmentStatus.model_validate(restored)
        assert restored["restored_pending"] == ["r0-a1", "r1-a1", "r2-a1", "r3-a1"]
        assert (restored["workers"], restored["session_aliases"], restored["session_placements"]) == (2, 0, 0)
        await gym.control.resume_all("r1")
        await trainer.continue_on(second.urls["environment"])
        assert await trainer.wait_results() == expected_results(tasks)


def test_the_merged_report_keeps_every_workers_restarts() -> None:
    """Gym's `merge()` (`participant_workers.py`) keeps `restarts`: the sorted union of the workers'."""
    env = CoordinatedEnvironment(2)
    for rollout, worker, restart, mid_turn in (
        ("r2", 1, True, False),
        ("r0", 0, True, False),
        ("r1", 0, False, True),
    ):
        ep = Episode(EpisodeId(rollout_id=rollout, attempt=0), "d", 3, 1, "s", worker)
        ep.restart, ep.mid_turn = restart, mid_turn
        env.live[ep.key] = ep
    merged = env.readiness()
    assert merged.restarts == ["r0", "r2"]
    assert (merged.ready, merged.blockers, merged.blocker_count) == (False, ["r1"], 1)
    assert merged.counts == {"episodes": 3, "workers": 2}
    assert [env._worker_report(w).restarts for w in (0, 1)] == [["r0"], ["r2"]]
    m2.PrepareReport.model_validate(merged.model_dump(mode="json"))
