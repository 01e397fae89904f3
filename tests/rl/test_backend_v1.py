"""quiesce as NeMo RL's environment checkpoint backend on Gym's v1 plane, with two Gym deployments:
real Ray actors standing in for RL's Gym actors (each a real gymsim v1 deployment whose servers
report the same Gym names as the other's), a real SQLite ledger, real files.

On v1 the snapshot goes into quiesce's snapshots folder and RL's folder receives a pointer to it;
each deployment commits into its own folder there (`gym-instances/<shard>/replica-<i>`), each
policy model with its own deployment's continuation indexes only, and a restore into fresh
deployments lists each RL instance's continued rollouts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from quiesce.coordinator.protocol import agent_instance_dir
from quiesce.ledger import Ledger
from quiesce.rl.backend import POINTER, QuiesceEnvironmentCheckpoint
from quiesce.rl.episodes import Episode
from quiesce.tools.audit.cli import check_ledger
from tests.rl.conftest import StartActors, backend_over, settings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

INSTANCES = ("nemo_gym/replica-0", "nemo_gym/replica-1")
#: Rollouts per RL instance (distinct ids: one trainer runs them all), too long to finish here.
ROLLOUTS = {INSTANCES[0]: {"a0": 1_000_000, "a1": 1_000_000}, INSTANCES[1]: {"b0": 1_000_000}}


class Cut:
    """RL's data-plane cut, held (v1 names no episodes: the backend compares nothing)."""

    def require_live(self) -> None:
        return None


async def turned(shards: Any) -> None:
    """Wait (up to a minute) until every rollout of every deployment has finished a turn, so it has
    called its deployment's model."""
    for handle in shards.checkpoint_handles.values():
        for _ in range(1200):
            if all(v["turns_done"] >= 1 for v in (await handle.rollouts.remote()).values()):
                break
            await anyio.sleep(0.05)
        else:
            raise AssertionError("a rollout finished no turn within a minute")


async def test_two_v1_deployments_snapshot_each_into_its_folder_and_restore_into_fresh_ones(
    gym_actors: StartActors, tmp_path: Path, backends: list[QuiesceEnvironmentCheckpoint]
) -> None:
    shards = await gym_actors("v1")
    for instance, handle in shards.checkpoint_handles.items():
        await handle.start_rollouts.remote(ROLLOUTS[instance])
    await turned(shards)  # every rollout's model calls have begun: each model has a ledger to save
    backend = backend_over(shards, settings(tmp_path, "v1"), backends, expected=lambda cut: [])
    await backend.start()
    discovery = backend.coordinator.discovery
    assert discovery is not None
    # both deployments' servers report the same Gym names, each deployment in its own folder
    assert {m.gym_name for m in discovery.participants} == {"policy_model", "simple_agent", "tools"}
    assert {m.folder for m in discovery.participants} == {f"gym-instances/{i}" for i in INSTANCES}
    path = tmp_path / "rl" / "step_3"
    path.mkdir(parents=True)
    async with backend.snapshot(path) as snap:
        await snap.check_against_cut(Cut())
    pointer = json.loads((path / POINTER).read_text())
    assert pointer["checkpoint_id"] == snap.checkpoint_id
    snapshot = Path(pointer["snapshot"])
    assert not (path / "gym_checkpoint.json").exists()  # v1 names no episodes
    for instance in INSTANCES:
        own = snapshot / "gym-instances" / instance
        for rel in ("model-ledger/policy_model", agent_instance_dir("simple_agent"), "resources/tools"):
            assert await anyio.Path(own / rel / "manifest.json").is_file()
        # each deployment's model saved its own deployment's rollouts, no other
        ledger = json.loads((own / "model-ledger/policy_model/manifest.json").read_text())
        assert set(ledger["rollouts"]) == set(ROLLOUTS[instance])
    url = settings(tmp_path, "v1")["quiesce"]["ledger"]
    async with Ledger.open(url, readonly=True) as ledger:
        events = [e async for e in ledger.read(checkpoint_id=snap.checkpoint_id)]
    models = [
        e for e in events if e.kind == "call.sent" and e.data["path"].endswith("model-checkpoint/commit")
    ]
    assert [len(e.data["body"]["continuation_indexes"]) for e in models] == [1, 1]
    await backend.aclose()

    # RL restarts: fresh deployments, a fresh backend over the same ledger, restored from the pointer
    fresh = await gym_actors("v1")
    again = backend_over(fresh, settings(tmp_path, "v1"), backends)
    restored = await again.restore(path)
    assert restored.source_checkpoint_id == snap.checkpoint_id
    assert dict(restored.by_instance) == {
        instance: tuple(Episode(rid, 1) for rid in sorted(rollouts))
        for instance, rollouts in ROLLOUTS.items()
    }
    # each fresh deployment continues its own rollouts, as attempt 1, from where they were saved
    saved: dict[str, dict[str, int]] = {}
    for instance, handle in fresh.checkpoint_handles.items():
        views = await handle.rollouts.remote()
        assert {r: v["status"] for r, v in views.items()} == {r: "restored" for r in ROLLOUTS[instance]}
        saved[instance] = {r: v["turns_done"] for r, v in views.items()}
        await handle.resubmit.remote([(e.rollout_id, e.attempt) for e in restored.by_instance[instance]])
    for instance, handle in fresh.checkpoint_handles.items():
        with anyio.fail_after(60):
            while True:
                views = await handle.rollouts.remote()
                if all(
                    v["attempt_index"] == 1 and v["turns_done"] > saved[instance][r] for r, v in views.items()
                ):
                    break
                await anyio.sleep(0.05)
    await again.aclose()
    assert (await check_ledger(url)).violations == []
