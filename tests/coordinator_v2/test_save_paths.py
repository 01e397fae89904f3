"""The unified plane's save paths through the coordinator, against real v2 reference servers:
blockers named and rolled back, restarts left out of the scope, a caller block kept alive by lease
renewals, a renewal that finds its server resumed, stop-checkpoints, a cluster that cannot derive
its scope."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator import (
    Attempt,
    ClusterConfig,
    Coordinator,
    DeadlineExceeded,
    EpisodeId,
    PhaseError,
    QuiesceError,
)
from quiesce.coordinator.protocol_v2 import PREFIX
from quiesce.tools.gymsim.v2.trainer import Trainer, expected_results, make_tasks
from tests.coordinator_v2.helpers import events, phases

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


async def test_not_ready_by_the_deadline_names_the_blockers_and_rolls_back(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    sqlite_url: str,
    http: httpx.AsyncClient,
    token: str,
) -> None:
    tasks = make_tasks(3, turns=3)
    with v2_cluster() as running:
        trainer = Trainer(running.urls["environment"], http=http)
        await trainer.start(tasks, paced=True)
        await trainer.wait_parked()
        await trainer.hold_mid_turn(["r1"])
        async with Coordinator.open(config_of(running, sqlite_url)) as coord:
            with pytest.raises(DeadlineExceeded) as caught:
                await coord.checkpoint(deadline_s=1.5)
        message = str(caught.value)
        assert "not ready by the deadline" in message
        assert "environment: blocked by 1 episode (r1)" in message
        assert "rolled back" in message
        # everyone prepared is resumed; the episode finishes once released
        assert set((await phases(http, running.urls, token)).values()) == {"idle"}
        await trainer.release()
        await trainer.unpace()
        assert await trainer.wait_results() == expected_results(tasks)
    blocked = await events(sqlite_url, "episodes.blocked")
    assert blocked[-1].data == {"blockers": {"environment": ["r1"]}, "counts": {"environment": 1}}
    aborted = await events(sqlite_url, "attempt.aborted")
    assert aborted[-1].data["left_paused"] == []
    # stage order: nothing after the environment stage was asked to prepare
    prepared = [
        ev.server for ev in await events(sqlite_url, "call.sent") if ev.data["path"].endswith("/prepare")
    ]
    assert set(prepared) == {"environment"}


async def test_the_callers_block_outlasting_a_lease_grace_is_kept_alive_by_renewals(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    sqlite_url: str,
    http: httpx.AsyncClient,
    token: str,
) -> None:
    grace = {"lease_grace_s": 1.0}
    tasks = make_tasks(2, turns=3)
    with v2_cluster(environment=grace, policy_model=grace, agent=grace, resources=grace) as running:
        trainer = Trainer(running.urls["environment"], http=http)
        await trainer.start(tasks, paced=True)
        await trainer.advance(1)
        await trainer.wait_parked()
        async with (
            Coordinator.open(config_of(running, sqlite_url)) as coord,
            coord.save(deadline_s=1.5) as attempt,
        ):
            # three lease graces past the deadline: without renewals every server would have
            # resumed by itself
            await anyio.sleep(3.5)
            assert set((await phases(http, running.urls, token)).values()) == {"committed"}
        assert attempt.snapshot is not None
        assert set((await phases(http, running.urls, token)).values()) == {"idle"}
        await trainer.detach()
    renewals = [ev for ev in await events(sqlite_url, "call.sent") if ev.data["path"].endswith("/renew")]
    assert len(renewals) >= 4 * 4  # every server, every ~0.5 s
    replied = {ev.call_id for ev in await events(sqlite_url, "call.replied")}
    assert all(ev.call_id in replied for ev in renewals)


async def test_a_renewal_that_finds_its_server_resumed_fails_the_save_and_publishes_nothing(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    sqlite_url: str,
    http: httpx.AsyncClient,
    token: str,
) -> None:
    with v2_cluster() as running:
        trainer = Trainer(running.urls["environment"], http=http)
        await trainer.start(make_tasks(2, turns=3), paced=True)
        await trainer.wait_parked()
        async with Coordinator.open(config_of(running, sqlite_url)) as coord:
            seen: list[Attempt] = []

            async def block() -> None:
                async with coord.save(deadline_s=1.0) as attempt:
                    seen.append(attempt)
                    # someone else resumes the agent while the caller writes its half
                    reply = await http.post(
                        f"{running.urls['agent']}{PREFIX}/resume",
                        json={"checkpoint_id": attempt.checkpoint_id, "deadline_ts": time.time() + 5},
                        headers={"authorization": f"Bearer {token}"},
                    )
                    assert reply.status_code == 200
                    await anyio.sleep(1.0)  # a renewal runs meanwhile

            with pytest.raises(PhaseError) as caught:
                await block()
            attempt = seen[0]
        assert "agent no longer holds checkpoint" in str(caught.value)
        assert "rolled back" in str(caught.value)
        assert attempt.state == "aborted"
        assert attempt.staging_dir is not None
        assert not attempt.staging_dir.exists()
        assert not (attempt.staging_dir.parent.parent / attempt.checkpoint_id).exists()
        assert set((await phases(http, running.urls, token)).values()) == {"idle"}
        await trainer.detach()
    assert await events(sqlite_url, "attempt.published") == []


async def test_a_stop_checkpoint_publishes_and_leaves_the_servers_paused(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    sqlite_url: str,
    http: httpx.AsyncClient,
    token: str,
) -> None:
    tasks = make_tasks(3, turns=4)
    with v2_cluster() as running:
        trainer = Trainer(running.urls["environment"], http=http)
        await trainer.start(tasks, paced=True)
        await trainer.advance(2)
        await trainer.wait_parked()
        async with Coordinator.open(config_of(running, sqlite_url)) as coord:
            attempt = await coord.checkpoint(deadline_s=10, stop=True)
            status = await coord.status()
        assert attempt.snapshot is not None
        assert set((await phases(http, running.urls, token)).values()) == {"committed"}
        held = {s.name: s for s in status.servers}
        assert all(s.held_by == attempt.checkpoint_id for s in held.values())
        holder = held["environment"].holder
        assert holder is not None
        assert "stop-checkpoint" in holder.state
        await trainer.detach()
    completed = await events(sqlite_url, "attempt.completed")
    assert completed[-1].data == {"servers": [], "outcome": "published"}
    resumes = [ev for ev in await events(sqlite_url, "call.sent") if ev.data["path"].endswith("/resume")]
    assert resumes == []
    commits = [ev for ev in await events(sqlite_url, "call.sent") if ev.data["path"].endswith("/commit")]
    assert {ev.data["body"]["stop"] for ev in commits} == {True}
    # the way on: a restore into fresh servers, finishing exactly
    with v2_cluster() as fresh:
        async with Coordinator.open(config_of(fresh, sqlite_url)) as coord:
            await coord.restore(attempt.snapshot, resume=True)
        await trainer.continue_on(fresh.urls["environment"])
        assert await trainer.wait_results() == expected_results(tasks)


async def test_a_cluster_without_an_environment_needs_the_callers_scope(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    sqlite_url: str,
) -> None:
    spec = {
        "servers": [
            {"kind": "model", "plane": "v2", "name": "policy_model"},
            {
                "kind": "agent",
                "plane": "v2",
                "name": "agent",
                "policy": "policy_model",
                "resources": "resources",
            },
            {"kind": "resources", "plane": "v2", "name": "resources"},
        ]
    }
    with v2_cluster(spec) as running:
        async with Coordinator.open(config_of(running, sqlite_url)) as coord:
            with pytest.raises(QuiesceError, match="no environment server") as caught:
                await coord.checkpoint(deadline_s=5)
            assert "--episodes FILE" in str(caught.value)
            posts = [ev for ev in await events(sqlite_url, "call.sent") if ev.data["method"] == "POST"]
            assert posts == []  # refused before any request
            attempt = await coord.checkpoint(
                deadline_s=5, episodes=[EpisodeId(rollout_id="x1"), EpisodeId(rollout_id="x2", attempt=1)]
            )
    assert attempt.scope == ("x1", "x2-a1")
    scoped = (await events(sqlite_url, "episodes.scoped"))[-1].data
    assert scoped["source"] == "given"
    commits = [ev for ev in await events(sqlite_url, "call.sent") if ev.data["path"].endswith("/commit")]
    assert len(commits) == 3
    for ev in commits:
        assert ev.data["body"]["episode_ids"] == [
            {"rollout_id": "x1", "attempt": 0},
            {"rollout_id": "x2", "attempt": 1},
        ]
