"""`Coordinator.rollouts` against real v2 reference servers: a save, a restore into a fresh
cluster, and a trainer that continues all but one restored attempt, then a save — the embedded
API reads from its own ledger what `quiesce rollouts` shows: the dropped rollout lost with its
steps, the others live; a selection by ids keeps their order; an unknown state is a
`ConfigError`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from quiesce.coordinator import ClusterConfig, ConfigError, Coordinator, EpisodeId
from quiesce.tools.gymsim.v2.trainer import Trainer, make_tasks

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


async def test_rollouts_reads_the_lineage_of_its_own_ledger(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    sqlite_url: str,
    http: httpx.AsyncClient,
) -> None:
    with v2_cluster() as first:
        trainer = Trainer(first.urls["environment"], http=http)
        await trainer.start(make_tasks(4, turns=5), paced=True)
        await trainer.advance(2)
        await trainer.wait_parked()
        async with Coordinator.open(config_of(first, sqlite_url)) as coord:
            assert await coord.rollouts() == []  # nothing saved yet
            saved = await coord.checkpoint(deadline_s=20)
            assert [(r.rollout_id, r.state, r.attempt) for r in await coord.rollouts()] == [
                (f"r{i}", "live", 0) for i in range(4)
            ]
        await trainer.detach()
    assert saved.snapshot is not None

    with v2_cluster() as second:
        async with Coordinator.open(config_of(second, sqlite_url)) as coord:
            restored = await coord.restore(saved.snapshot, resume=True)
            # the trainer continues r0..r2 and never sends r3's /run
            await trainer.continue_on(second.urls["environment"], ["r0", "r1", "r2"], paced=True)
            await trainer.wait_parked()
            kept = [EpisodeId(rollout_id=f"r{i}", attempt=1) for i in range(3)]
            later = await coord.checkpoint(deadline_s=20, episodes=kept)

            [r3] = await coord.rollouts("r3")
            assert (r3.rollout_id, r3.state, r3.attempt) == ("r3", "lost", 1)
            assert [(s.what, s.attempt, s.checkpoint_id) for s in r3.steps] == [
                ("captured", 0, saved.checkpoint_id),
                ("continued", 1, restored.checkpoint_id),
                ("lost", 1, later.checkpoint_id),
            ]
            live = await coord.rollouts(state="live")
            assert [(r.rollout_id, r.attempt) for r in live] == [(f"r{i}", 1) for i in range(3)]
            assert [(s.what, s.checkpoint_id) for s in live[0].steps] == [
                ("captured", saved.checkpoint_id),
                ("continued", restored.checkpoint_id),
                ("captured", later.checkpoint_id),
            ]
            assert [r.state for r in await coord.rollouts(state="lost")] == ["lost"]
            # by ids: in the order asked, each once, an id never recorded left out
            picked = await coord.rollouts(["r2", "nope", "r0", "r2"])
            assert [r.rollout_id for r in picked] == ["r2", "r0"]
            assert await coord.rollouts("r3", state="live") == []
            assert await coord.rollouts([]) == []
            with pytest.raises(ConfigError, match=r"no rollout state 'gone'; the states are live, restarted"):
                await coord.rollouts(state="gone")
        await trainer.detach()
