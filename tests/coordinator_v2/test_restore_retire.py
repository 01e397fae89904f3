"""Restarts, a failed restore's cleanup, and retire/forget through the coordinator, against real
v2 reference servers."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator import ClusterConfig, Coordinator, EpisodeId, PhaseError, QuiesceError
from quiesce.tools.gymsim.v2.trainer import Trainer, expected_results, make_tasks
from tests.coordinator_v2.helpers import events, phases, sent

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


async def test_restarts_are_left_out_of_the_scope_and_listed(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    sqlite_url: str,
    http: httpx.AsyncClient,
) -> None:
    tasks = make_tasks(3, turns=4)
    with v2_cluster(resources={"checkpoint_mode": "restart_only"}) as running:
        trainer = Trainer(running.urls["environment"], http=http)
        await trainer.start(tasks, paced=True)
        await trainer.advance(1)
        await trainer.wait_parked()
        async with Coordinator.open(config_of(running, sqlite_url)) as coord:
            attempt = await coord.checkpoint(deadline_s=10)
        await trainer.detach()
    # A restart-only resources server's seed reply carries x-ng-checkpoint-restart: 1, and Gym marks
    # the seeding episode a restart wherever that reply lands: the environment (single-agent-turn
    # environment server, `seed_restarts` → `checkpoint_restart`) and here also the agent, which
    # seeds the resources session itself (Gym's legacy /run agent: `LegacyRun.mark_restart`).
    everyone = ("r0", "r1", "r2")
    assert attempt.restarts == {"environment": everyone, "agent": everyone, "resources": everyone}
    assert attempt.scope == ()
    scoped = (await events(sqlite_url, "episodes.scoped"))[-1].data
    assert scoped["restarts"] == {n: list(everyone) for n in ("environment", "agent", "resources")}
    for ev in await sent(sqlite_url, "commit"):
        if ev.server != "environment":
            assert ev.data["body"]["episode_ids"] == []
    # nothing outside the (empty) scope was exported: not even by the environment's unscoped commit
    assert attempt.exported == dict.fromkeys(attempt.exported, ())
    assert set(attempt.exported) == {"environment", "agent", "policy_model", "resources"}


async def test_a_failed_restore_retires_the_next_attempts_everywhere_and_resumes_everyone(
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
            saved = await coord.checkpoint(deadline_s=10)
        await trainer.detach()
    assert saved.snapshot is not None
    fault = {"kind": "fail", "path": "/checkpoint/restore", "status": 409, "code": "checkpoint_error"}
    with v2_cluster(resources={"faults": [fault]}) as fresh:
        async with Coordinator.open(config_of(fresh, sqlite_url)) as coord:
            with pytest.raises(PhaseError) as caught:
                await coord.restore(saved.snapshot)
        message = str(caught.value)
        assert "restore failed at resources" in message
        assert "retired the next attempts of its 3 episodes on every server" in message
        assert "resumed everyone" in message
        assert set((await phases(http, fresh.urls, token)).values()) == {"idle"}
        # nothing restored runs: the replacement attempts are refused everywhere
        reply = await http.post(
            f"{fresh.urls['environment']}/run",
            json={"episode_id": {"rollout_id": "r0", "attempt": 1}, "task": tasks["r0"]},
            timeout=30,
        )
        assert reply.status_code == 409
        assert reply.json()["error"]["code"] == "stale_attempt"
    retires = await sent(sqlite_url, "retire")
    order = [ev.server for ev in retires]
    assert order[0] == "environment"
    assert order[1] == "agent"
    assert set(order[2:]) == {"policy_model", "resources"}
    assert all(
        ev.data["body"]["episode_ids"] == [{"rollout_id": f"r{i}", "attempt": 1} for i in range(3)]
        for ev in retires
    )
    retired = (await events(sqlite_url, "episodes.retired"))[-1]
    assert retired.data["episodes"] == ["r0-a1", "r1-a1", "r2-a1"]
    aborted = (await events(sqlite_url, "attempt.aborted"))[-1].data
    assert aborted["left_paused"] == []
    assert sorted(aborted["resumed"]) == sorted(fresh.urls)


async def test_retire_and_forget_go_callers_first_and_are_refused_while_a_save_is_open(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    sqlite_url: str,
    http: httpx.AsyncClient,
) -> None:
    tasks = make_tasks(2, turns=3)
    with v2_cluster() as running:
        trainer = Trainer(running.urls["environment"], http=http)
        await trainer.start(tasks, paced=True)
        await trainer.wait_parked()
        async with Coordinator.open(config_of(running, sqlite_url)) as coord:
            attempt = await coord.prepare(deadline_s=10)
            with pytest.raises(QuiesceError, match="resume first"):
                await coord.retire([EpisodeId(rollout_id="r0")])
            assert await sent(sqlite_url, "retire") == []
            await coord.abort(attempt)
            outcome = await coord.retire([EpisodeId(rollout_id="r0")])
            assert outcome.ok
            assert outcome.items == ("r0",)
            # r0's attempt 0 is stopped and refused from now on; r1 runs on
            again = await http.post(
                f"{running.urls['environment']}/run",
                json={"episode_id": {"rollout_id": "r0", "attempt": 0}, "task": tasks["r0"]},
                timeout=30,
            )
            assert again.json()["error"]["code"] == "stale_attempt"
            forgotten = await coord.forget(["r0", "r0"])
            assert forgotten.items == ("r0",)
        await trainer.unpace(["r1"])
        await trainer.wait_done(["r1"])
        assert trainer.results["r1"] == expected_results(tasks)["r1"]
    for operation in ("retire", "forget"):
        order = [ev.server for ev in await sent(sqlite_url, operation)]
        assert order[:2] == ["environment", "agent"], operation
        assert set(order[2:]) == {"policy_model", "resources"}, operation
    forget_body = (await sent(sqlite_url, "forget"))[0].data["body"]
    assert forget_body["rollout_ids"] == ["r0"]
    assert [ev.data["rollout_ids"] for ev in await events(sqlite_url, "rollouts.forgotten")] == [["r0"]]


async def test_a_failed_restore_of_a_copied_snapshot_carries_the_provenance_warning(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    tmp_path: Path,
    http: httpx.AsyncClient,
) -> None:
    """A snapshot another ledger published, copied in, whose restore then fails at a server: the
    error carries what was not verified, as a successful restore's outcome would."""
    tasks = make_tasks(2, turns=4)
    first_ledger = f"sqlite+aiosqlite:///{tmp_path / 'a.db'}"
    with v2_cluster() as running:
        trainer = Trainer(running.urls["environment"], http=http)
        await trainer.start(tasks, paced=True)
        await trainer.advance(2)
        await trainer.wait_parked()
        async with Coordinator.open(config_of(running, first_ledger)) as coord:
            saved = await coord.checkpoint(deadline_s=10)
        await trainer.detach()
    assert saved.snapshot is not None
    copied = tmp_path / "copied" / saved.snapshot.name
    shutil.copytree(saved.snapshot, copied)
    fault = {"kind": "fail", "path": "/checkpoint/restore", "status": 409, "code": "checkpoint_error"}
    with v2_cluster(resources={"faults": [fault]}) as fresh:
        other = config_of(fresh, f"sqlite+aiosqlite:///{tmp_path / 'b.db'}")
        async with Coordinator.open(other) as coord:
            with pytest.raises(PhaseError) as caught:
                await coord.restore(copied)
    assert "restore failed at resources" in str(caught.value)
    assert len(caught.value.warnings) == 1, caught.value.warnings
    assert "was not published by this ledger" in caught.value.warnings[0]
