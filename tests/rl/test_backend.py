"""quiesce as NeMo RL's environment checkpoint backend, driven exactly as RL's controller drives
one, against real Ray actors standing in for RL's Gym actors (each runs a real gymsim deployment
with its head server), a real SQLite ledger, and real files.

RL's order (nightly `interfaces` docs): enter `snapshot(path)` (paused) → take the cut → check the
snapshot against it → write RL's own half into `path` → release the cut → leave (resumed). Restore:
into fresh deployments, the continued episodes (attempt n + 1) must be what was committed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from quiesce.coordinator.publish import IN_PLACE_MANIFEST
from quiesce.ledger import Ledger
from quiesce.ledger.lineage import read_lineage
from quiesce.rl.backend import POINTER, QuiesceEnvironmentCheckpoint
from quiesce.rl.builder import build_quiesce_environment_checkpoint
from quiesce.rl.episodes import Episode
from quiesce.rl.errors import EnvironmentCheckpointError
from quiesce.rl.gym_manifest import GymCheckpointManifest
from quiesce.tools.audit.cli import check_ledger
from quiesce.tools.gymsim.v2.trainer import expected_results, make_tasks
from tests.rl.conftest import ShardSet, StartActors, backend_over, env_handles, settings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

INSTANCES = ("nemo_gym/replica-0", "nemo_gym/replica-1")


@dataclass
class Cut:
    """RL's data-plane cut as the backend sees it: held until released (`require_live`)."""

    held: bool = True

    def require_live(self) -> None:
        if not self.held:
            raise RuntimeError("the data-plane barrier was released")


async def in_flight(shards: ShardSet) -> list[Episode]:
    """What RL's recovery ledger would say is in flight: every unfinished episode of every actor."""
    out: list[Episode] = []
    for handle in shards.checkpoint_handles.values():
        out.extend(Episode.coerce(e) for e in await handle.in_flight.remote())
    return out


async def parked(shards: ShardSet, tasks: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Episodes running on every actor, two turns in, parked at that boundary."""
    for (instance, handle), prefix in zip(shards.checkpoint_handles.items(), ("a", "b"), strict=True):
        await handle.start_episodes.remote(tasks[instance], paced=True)
        await handle.advance.remote(2)
        await handle.wait_parked.remote()
        assert prefix  # tasks are named per instance


def tasks_for() -> dict[str, dict[str, dict[str, Any]]]:
    return {
        INSTANCES[0]: make_tasks(3, turns=4, prefix="a"),
        INSTANCES[1]: make_tasks(2, turns=4, prefix="b"),
    }


async def test_snapshot_cut_check_and_exact_restore_into_fresh_deployments(
    gym_actors: StartActors, tmp_path: Path, backends: list[QuiesceEnvironmentCheckpoint]
) -> None:
    tasks = tasks_for()
    shards = await gym_actors("v2")
    await parked(shards, tasks)
    backend = build_quiesce_environment_checkpoint(
        settings(tmp_path),
        env_handles=env_handles(shards, math=object()),
        rollout_manager=None,
        dp_client=None,
        expected=lambda cut: in_flight(shards),
    )
    backends.append(backend)
    path = tmp_path / "rl" / "step_5"
    path.mkdir(parents=True)
    async with backend.snapshot(path) as snap:  # every Gym server paused and committed
        cut = Cut()
        await snap.check_against_cut(cut)
        (path / "tq.pt").write_bytes(b"RL's transfer queue")  # RL's own half
        cut.held = False
    assert snap.checked
    committed = {e.capture_key for e in snap.episodes}
    assert committed == {e.capture_key for e in await in_flight(shards)}
    # RL's format: gym_checkpoint.json names each instance's episodes, in its folder beside its state
    manifest = GymCheckpointManifest.load(path)
    assert sorted(manifest.instances) == list(INSTANCES)
    assert {e.capture_key for e in manifest.episodes()} == committed
    assert set(manifest.instances[INSTANCES[1]]) == {Episode("b0", 0), Episode("b1", 0)}
    assert all(manifest.staging_keys[i] for i in INSTANCES)  # the model's rows of those episodes
    for instance in INSTANCES:
        assert (
            path / "gym-instances" / instance / "gym" / "environment" / "environment" / "manifest.json"
        ).is_file()
    assert json.loads((path / IN_PLACE_MANIFEST).read_text())["roots"] == [
        f"gym-instances/{i}" for i in INSTANCES
    ]
    assert (path / "tq.pt").read_bytes() == b"RL's transfer queue"
    states = {i: await h.episodes_state.remote() for i, h in shards.checkpoint_handles.items()}
    for handle in shards.checkpoint_handles.values():
        await handle.detach.remote()
    await backend.aclose()

    # RL restarts: fresh deployments, a fresh backend over the same ledger
    fresh = await gym_actors("v2")
    again = backend_over(fresh, settings(tmp_path), backends)
    restored = await again.restore(path)
    assert restored.source_checkpoint_id == snap.checkpoint_id
    assert dict(restored.by_instance) == dict(manifest.next_attempts())
    assert restored.continued_from() == manifest.episodes()
    for instance, handle in fresh.checkpoint_handles.items():
        started = await handle.continue_episodes.remote(states[instance])
        assert sorted(Episode.coerce(e) for e in started) == sorted(restored.by_instance[instance])
        assert await handle.wait_results.remote() == expected_results(tasks[instance])
    url = settings(tmp_path)["quiesce"]["ledger"]
    await again.aclose()
    report = await check_ledger(url)
    assert report.violations == []
    # the lineage covers the whole run: every rollout of both deployments, continued by the restore
    assert report.rollouts is not None
    assert sum(report.rollouts.values()) == 5
    async with Ledger.open(url, readonly=True) as ledger:
        lineage = await read_lineage(ledger)
    assert {r: (x.attempt, x.state) for r, x in lineage.rollouts.items()} == {
        e.rollout_id: (1, "live") for e in manifest.episodes()
    }


async def test_a_cut_that_does_not_match_rolls_the_snapshot_back(
    gym_actors: StartActors, tmp_path: Path, backends: list[QuiesceEnvironmentCheckpoint]
) -> None:
    shards = await gym_actors("v2")
    await parked(shards, tasks_for())
    ghost = Episode("never-started", 0)

    async def rl_view(cut: Any) -> list[Episode]:
        return [*await in_flight(shards), ghost]

    backend = backend_over(shards, settings(tmp_path), backends, expected=rl_view)
    path = tmp_path / "rl" / "step_6"
    path.mkdir(parents=True)
    (path / "tq.pt").write_bytes(b"RL")
    with pytest.raises(EnvironmentCheckpointError) as caught:
        async with backend.snapshot(path) as snap:
            await snap.check_against_cut(Cut())
    error = caught.value
    assert (error.operation, error.code, error.transient) == ("check_against_cut", "cut_mismatch", False)
    assert "never-started" in str(error)
    # rolled back: every server resumed, nothing of Gym's left in RL's folder
    assert sorted(p.name for p in path.iterdir()) == ["tq.pt"]
    assert not (path / "gym_checkpoint.json").exists()
    # the servers are let go (the episodes stay parked at their boundary, so the scope holds
    # still): a second snapshot, with a view that matches, goes through
    backend._expected = lambda cut: in_flight(shards)  # RL's view now agrees
    path2 = tmp_path / "rl" / "step_7"
    path2.mkdir()
    async with backend.snapshot(path2) as snap:
        await snap.check_against_cut(Cut())
    assert (path2 / "gym_checkpoint.json").is_file()


async def test_a_failed_restore_cleans_up_every_deployment(
    gym_actors: StartActors, tmp_path: Path, backends: list[QuiesceEnvironmentCheckpoint]
) -> None:
    shards = await gym_actors("v2")
    await parked(shards, tasks_for())
    backend = backend_over(shards, settings(tmp_path), backends, expected=lambda cut: in_flight(shards))
    path = tmp_path / "rl" / "step_8"
    path.mkdir(parents=True)
    async with backend.snapshot(path) as snap:
        await snap.check_against_cut(Cut())
    await backend.aclose()
    # restoring into the same, used deployments: Gym refuses a restore into a process that holds
    # live episodes, so the restore fails — and must leave no deployment paused or half-restored
    again = backend_over(shards, settings(tmp_path), backends)
    with pytest.raises(EnvironmentCheckpointError) as caught:
        await again.restore(path)
    assert caught.value.operation == "restore"
    status = await again.coordinator.status()
    assert {s.name: s.held_by for s in status.servers} == {s.name: None for s in status.servers}
    text = str(caught.value)
    assert "retired the next attempts" in text
    assert "Everyone is resumed" in text
    async with Ledger.open(settings(tmp_path)["quiesce"]["ledger"], readonly=True) as ledger:
        ended = [e async for e in ledger.read() if e.kind in ("attempt.aborted", "attempt.completed")]
    assert ended[-1].kind == "attempt.aborted"  # the restore, all or nothing


async def test_a_v1_deployment_snapshots_into_quiesce_and_rls_folder_names_it(
    gym_actors: StartActors, tmp_path: Path, backends: list[QuiesceEnvironmentCheckpoint]
) -> None:
    # one deployment (two, each in its folder: tests/rl/test_backend_v1.py)
    shards = await gym_actors("v1", replicas=1)
    for handle in shards.checkpoint_handles.values():
        await handle.start_rollouts.remote({"a0": 1_000_000, "a1": 1_000_000})
    config = settings(tmp_path)
    config["quiesce"]["plane"] = "v1"
    backend = backend_over(shards, config, backends, expected=lambda cut: [])
    path = tmp_path / "rl" / "step_9"
    path.mkdir(parents=True)
    async with backend.snapshot(path) as snap:
        await snap.check_against_cut(Cut())
    pointer = json.loads((path / POINTER).read_text())
    assert pointer["checkpoint_id"] == snap.checkpoint_id
    assert await anyio.Path(pointer["snapshot"]).is_dir()
    assert not (path / "gym_checkpoint.json").exists()  # v1 names no episodes
    await backend.aclose()
    # the pointer restores: into a fresh deployment, the saved rollouts continue as attempt 1
    fresh = await gym_actors("v1", replicas=1)
    again = backend_over(fresh, config, backends)
    restored = await again.restore(path)
    assert restored.source_checkpoint_id == snap.checkpoint_id
    assert dict(restored.by_instance) == {"nemo_gym/replica-0": (Episode("a0", 1), Episode("a1", 1))}
