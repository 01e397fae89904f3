"""Multi-worker coordinator mode (Gym's `_checkpoint/participant_workers.py`) of the environment:
one phase machine over worker tables; merged report; one records file; restored records claimed
by whichever worker runs the replacement."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from quiesce.tools.gymsim.v2.trainer import expected_results, make_tasks
from tests.gymsim_v2.conftest import V2, running, v2_spec

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
        assert [w["episodes"] for w in status["workers"]] == [2, 2]
        assert status["session_aliases"] == {}
        not_ready = (await gym.op("environment", "prepare", "c1", deadline_s=0.3)).json()
        assert not_ready["phase"] == "preparing"
        held_workers = {live[k]["worker"] for k in ("r0", "r1")}
        assert not_ready["report"]["blockers"] == ["r0", "r1"]  # union over the workers
        assert not_ready["report"]["counts"]["episodes"] == 4  # sum over the workers
        workers = (await gym.state("environment"))["workers"]
        assert {w["worker"] for w in workers if not w["ready"]} == held_workers
        assert all(w["closed"] for w in workers)
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
    owners = {k: live[k]["worker"] for k in tasks}
    assert manifest["session_owners"] == owners
    records = [json.loads(line) for line in (folder / manifest["records_file"]).read_bytes().splitlines()]
    assert {r["episode_id"]["rollout_id"]: r["owner"] for r in records} == owners
    with running(SPEC) as second:
        gym = V2(second.urls, http)
        await gym.control.restore_all("r1", str(tmp_path), trainer.in_flight())
        assert (await gym.state("environment"))["restored_pending"] == ["r0-a1", "r1-a1", "r2-a1", "r3-a1"]
        await gym.control.resume_all("r1")
        await trainer.continue_on(second.urls["environment"])
        assert await trainer.wait_results() == expected_results(tasks)
