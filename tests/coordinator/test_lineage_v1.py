"""The rollout lineage on v1 against real gymsim servers: a save mid-rollout, the cluster gone, a
restore into a fresh one, the trainer resubmitting what the restore lists, one rollout finishing
(acknowledged), a second save — every rollout accounted for and `check` clean; then an agent
that loses its continuations (a restart) shows them lost at the next save."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest

from quiesce.coordinator import Coordinator
from quiesce.ledger import Ledger
from quiesce.ledger.lineage import read_lineage
from quiesce.tools.audit.cli import check_ledger
from quiesce.tools.gymsim import client
from quiesce.tools.gymsim.cluster import RunningCluster
from quiesce.tools.gymsim.spec import SpecLike
from tests.coordinator.helpers import assert_protocol_ok

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

MakeCluster = Callable[[SpecLike], AbstractContextManager[RunningCluster]]
AGENT = "simple_agent"


async def _slow(http: httpx.AsyncClient, running: RunningCluster) -> None:
    for name in ("policy_model", "tools"):
        await http.post(f"{running.urls[name]}/gymsim/admin/options", json={"latency_s": 0.1})


async def test_a_v1_run_accounts_for_every_rollout_then_shows_what_an_agent_lost(
    make_cluster: MakeCluster, sqlite_url: str, configure: Any
) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        with make_cluster(None) as first:
            await _slow(http, first)
            await client.start_rollouts(http, first.urls[AGENT], {"r0": 6, "r1": 30, "r2": 30})
            await client.wait_turns(http, first.urls[AGENT], 2)
            async with Coordinator.open(configure(first, sqlite_url)) as coord:
                found = await coord.discover()
                assert (
                    "completed_result_acknowledgement"
                    in (found.member(AGENT) or found.participants[0]).features
                )
                saved = await coord.checkpoint(deadline_s=30)
        assert saved.snapshot is not None  # the first cluster is gone: the run restarts from here

        with make_cluster(None) as second:
            await _slow(http, second)
            async with Coordinator.open(configure(second, sqlite_url)) as coord:
                restored = await coord.restore(saved.snapshot, resume=True)
                assert sorted((r.rollout_id, r.attempt_index) for r in restored.resubmit) == [
                    ("r0", 1),
                    ("r1", 1),
                    ("r2", 1),
                ]
                await client.resubmit(http, second.urls[AGENT], restored.resubmit_on(AGENT))
                # r0 has the fewest turns: it finishes, and the trainer acknowledges its result
                await client.wait_until(
                    http, second.urls[AGENT], lambda rs: rs["r0"]["status"] == "completed", timeout_s=60
                )
                assert await coord.acknowledge_completed(AGENT, [("r0", 1)]) == [("r0", 1)]
                later = await coord.checkpoint(deadline_s=30)
                clean = await check_ledger(sqlite_url)
                assert clean.violations == [], clean.violations
                assert clean.rollouts == {"live": 2, "restarted": 0, "retired": 0, "finished": 1, "lost": 0}
                async with Ledger.open(sqlite_url, readonly=True) as ledger:
                    lineage = await read_lineage(ledger)
                assert {r: (x.state, x.attempt) for r, x in lineage.rollouts.items()} == {
                    "r0": ("finished", 1),
                    "r1": ("live", 1),
                    "r2": ("live", 1),
                }
                assert [(s.what, s.attempt, s.checkpoint_id) for s in lineage.rollouts["r1"].steps] == [
                    ("captured", 0, saved.checkpoint_id),
                    ("continued", 1, restored.checkpoint_id),
                    ("captured", 1, later.checkpoint_id),
                ]
                assert [s.what for s in lineage.rollouts["r0"].steps] == [
                    "captured",
                    "continued",
                    "acknowledged",
                ]
                await assert_protocol_ok(sqlite_url)

                # a third cluster restores the second save; its agent then restarts, losing the
                # continuations the trainer had not yet resubmitted
        with make_cluster(None) as third:
            async with Coordinator.open(configure(third, sqlite_url)) as coord:
                again = await coord.restore(later.snapshot, resume=True)
                assert sorted((r.rollout_id, r.attempt_index) for r in again.resubmit) == [
                    ("r1", 2),
                    ("r2", 2),
                ]
                await client.restart(http, third.urls[AGENT])
                lost_at = await coord.checkpoint(deadline_s=30)
    report = await check_ledger(sqlite_url)
    assert sorted((v.rule, v.rollout_id, v.checkpoint_id) for v in report.violations) == [
        ("lineage-lost", "r1", lost_at.checkpoint_id),
        ("lineage-lost", "r2", lost_at.checkpoint_id),
    ]
    assert all(again.checkpoint_id in v.message for v in report.violations)
    assert report.rollouts == {"live": 0, "restarted": 0, "retired": 0, "finished": 1, "lost": 2}


async def test_v1_two_attempts_of_one_rollout_running_at_once_are_named(
    make_cluster: MakeCluster, sqlite_url: str, configure: Any
) -> None:
    from tests.coordinator.test_rollout_events import TWO_AGENTS

    async with httpx.AsyncClient(timeout=60) as http:
        with make_cluster(TWO_AGENTS) as running:
            await _slow(http, running)
            # a trainer that sends rollout r0 again, as attempt 1 on another agent, while attempt 0 runs
            await client.start_rollout(http, running.urls[AGENT], "r0", 30)
            await client.start_rollout(http, running.urls["idle_agent"], "r0", 30, attempt_index=1)
            await client.wait_turns(http, running.urls[AGENT], 2)
            await client.wait_turns(http, running.urls["idle_agent"], 2)
            async with Coordinator.open(configure(running, sqlite_url)) as coord:
                saved = await coord.checkpoint(deadline_s=30)
    report = await check_ledger(sqlite_url)
    assert [(v.rule, v.rollout_id, v.checkpoint_id) for v in report.violations] == [
        ("lineage-twice", "r0", saved.checkpoint_id)
    ]
    assert "attempts 0, 1 of rollout r0" in report.violations[0].message
