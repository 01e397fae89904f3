"""Exact restore: a run checkpointed mid-rollout and restored into a FRESH cluster finishes with the
results of an uninterrupted run (and of `logic.reference_result`), whatever turn each rollout was at."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from quiesce.coordinator.protocol_v2 import EpisodeId
from quiesce.tools.gymsim.v2.trainer import expected_results, make_tasks
from tests.gymsim_v2.conftest import V2, running

pytestmark = pytest.mark.anyio


async def test_uninterrupted_run_matches_the_reference(gym: V2) -> None:
    tasks = make_tasks(3, turns=4)
    trainer = gym.trainer()
    await trainer.start(tasks, paced=False)
    assert await trainer.wait_results() == expected_results(tasks)


async def test_checkpoint_mid_rollout_then_restore_into_a_fresh_cluster(
    http: httpx.AsyncClient, tmp_path: Path
) -> None:
    tasks = make_tasks(6, turns=5)
    folder = str(tmp_path / "ckpt")
    with running() as first:
        gym = V2(first.urls, http)
        trainer = gym.trainer()
        await trainer.start(tasks, paced=True)
        # rollouts at different turns: r0 and r1 at 0, r2 and r3 at 2, r4 at 4, r5 finished
        await trainer.advance(2, ["r2", "r3"])
        await trainer.advance(4, ["r4"])
        await trainer.unpace(["r5"])
        await trainer.wait_done(["r5"])
        await trainer.wait_parked()
        commits = await gym.control.checkpoint("c1", folder, trainer.in_flight(), stop=True)
        await trainer.detach()
    assert "r5" in trainer.results
    scope = trainer.in_flight()
    assert [e.capture_key for e in scope] == ["r0", "r1", "r2", "r3", "r4"]
    # the environment exports every live episode; the model only those that made a call
    assert commits["environment"]["episode_ids"] == ["r0", "r1", "r2", "r3", "r4"]
    assert commits["policy_model"]["episode_ids"] == ["r2", "r3", "r4"]
    with running() as second:
        gym = V2(second.urls, http)
        restored = await gym.control.restore_all("r-c1", folder, scope)
        assert restored["environment"]["restored"] == ["r0-a1", "r1-a1", "r2-a1", "r3-a1", "r4-a1"]
        assert restored["policy_model"]["restored"] == ["r2-a1", "r3-a1", "r4-a1"]
        assert {r["source_checkpoint_id"] for r in restored.values()} == {"c1"}
        assert (await gym.state("environment"))["restored_pending"] == [
            "r0-a1",
            "r1-a1",
            "r2-a1",
            "r3-a1",
            "r4-a1",
        ]
        await gym.control.resume_all("r-c1")
        started = await trainer.continue_on(second.urls["environment"])
        assert started == [EpisodeId(rollout_id=f"r{i}", attempt=1) for i in range(5)]
        results = await trainer.wait_results()
    assert results == expected_results(tasks)


async def test_a_lost_piece_of_state_changes_the_result(http: httpx.AsyncClient, tmp_path: Path) -> None:
    """The check above can fail: restore the environment alone and the continued rollouts differ."""
    tasks = make_tasks(2, turns=4)
    folder = str(tmp_path / "ckpt")
    with running() as first:
        gym = V2(first.urls, http)
        trainer = gym.trainer()
        await trainer.start(tasks, paced=True)
        await trainer.advance(2)
        await trainer.wait_parked()
        await gym.control.checkpoint("c1", folder, trainer.in_flight(), stop=True)
        await trainer.detach()
    with running() as second:
        gym = V2(second.urls, http)
        scope = trainer.in_flight()
        await gym.op(
            "environment", "restore", "r1", checkpoint_dir=folder, episode_ids=[e.model_dump() for e in scope]
        )
        await gym.op("environment", "resume", "r1")
        await trainer.continue_on(second.urls["environment"])
        results = await trainer.wait_results()
    expected = expected_results(tasks)
    assert all(results[rid] != expected[rid] for rid in tasks)
