"""A save and an exact restore on Gym's unified plane, driven by the coordinator against real v2
reference servers: mid-rollout, into a fresh cluster, finishing exactly as an uninterrupted run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from quiesce.coordinator import ClusterConfig, Coordinator
from quiesce.tools.gymsim.v2.trainer import Trainer, expected_results, make_tasks
from tests.coordinator_v2.helpers import events

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


async def test_mid_rollout_save_then_exact_restore_into_a_fresh_cluster(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    sqlite_url: str,
    http: httpx.AsyncClient,
) -> None:
    tasks = make_tasks(6, turns=5)
    with v2_cluster() as first:
        trainer = Trainer(first.urls["environment"], http=http)
        await trainer.start(tasks, paced=True)
        await trainer.advance(2, ["r2", "r3"])
        await trainer.advance(4, ["r4"])
        await trainer.unpace(["r5"])
        await trainer.wait_done(["r5"])
        await trainer.wait_parked()
        config = config_of(first, sqlite_url)
        async with Coordinator.open(config) as coord:
            found = await coord.discover()
            assert found.plane == "v2"
            assert sorted(m.component for m in found.participants) == [
                "agent",
                "environment",
                "model",
                "resources",
            ]
            attempt = await coord.checkpoint(deadline_s=20)
        await trainer.detach()
        in_flight = trainer.in_flight()
        assert trainer.results["r5"] == expected_results(tasks)["r5"]
    # the scope was derived from the environment's export: every rollout in flight
    assert attempt.scope == ("r0", "r1", "r2", "r3", "r4")
    assert [e.capture_key for e in in_flight] == list(attempt.scope)
    assert attempt.snapshot is not None
    assert (attempt.snapshot / "manifest.json").is_file()
    scoped = await events(sqlite_url, "episodes.scoped")
    assert scoped[-1].data["source"] == "derived"
    assert scoped[-1].data["scope"] == list(attempt.scope)
    exported = (await events(sqlite_url, "episodes.exported"))[-1].data["exported"]
    assert exported["environment"] == list(attempt.scope)

    with v2_cluster() as second:
        config = config_of(second, sqlite_url)
        async with Coordinator.open(config) as coord:
            restore = await coord.restore(attempt.snapshot, resume=True)
        assert restore.state == "completed"
        assert [(r.rollout_id, r.attempt_index) for r in restore.resubmit] == [(f"r{i}", 1) for i in range(5)]
        started = await trainer.continue_on(second.urls["environment"])
        assert [e.capture_key for e in started] == [f"r{i}-a1" for i in range(5)]
        results = await trainer.wait_results()
    assert results == expected_results(tasks)
    restored = (await events(sqlite_url, "episodes.restored"))[-1].data
    assert restored["source_checkpoint_id"] == attempt.checkpoint_id
    assert restored["restored"]["environment"] == [f"r{i}-a1" for i in range(5)]
