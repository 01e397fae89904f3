"""A restore into Gym servers that kept running since the save (what README warns of): the policy
model refuses it (409 `ledger_mismatch`: it holds rollouts the snapshot does not), quiesce stops at
once with both ways out in the error, nothing half-restored runs, and each way out works — the
id's resume runs the servers on as they were; freshly started servers take the same snapshot.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from quiesce.coordinator import Coordinator, PhaseError
from quiesce.tools.gymsim import client
from tests.coordinator.helpers import assert_all_accepting, server_states

pytestmark = pytest.mark.anyio


async def test_a_restore_into_used_servers_stops_and_names_the_ways_out(
    make_cluster: Any, ledger_url: str, configure: Any
) -> None:
    with make_cluster(None) as used:
        config = configure(used, ledger_url)
        agent = used.urls["simple_agent"]
        async with httpx.AsyncClient() as http, Coordinator.open(config) as coord:
            await client.start_rollouts(http, agent, {"saved-0": 3, "saved-1": 3})
            await client.wait_finished(http, agent, timeout_s=60)
            await coord.acknowledge_completed("simple_agent", [("saved-0", 0), ("saved-1", 0)])
            saved = await coord.checkpoint(deadline_s=30)
            assert saved.snapshot is not None
            # the run goes on past the save: the model now holds a rollout the snapshot does not
            await client.start_rollouts(http, agent, {"after-save": 2})
            await client.wait_finished(http, agent, timeout_s=60)
            with pytest.raises(PhaseError) as refused:
                await coord.restore(saved.snapshot)
            error = refused.value
            message = str(error)
            assert error.phase == "restore"
            assert error.server == "policy_model"
            assert "ledger_mismatch" in message
            assert "after-save" in message  # the lineage the snapshot lacks, by name
            assert "freshly started" in message
            restore_id = error.checkpoint_id
            assert restore_id is not None
            assert "quiesce resume --config" in message
            assert f" {restore_id}" in message
            # nothing half-restored runs: the model stays paused under the restore's id
            states = await server_states(http, used)
            assert states["policy_model"][1] != "accepting"
            status = await coord.status()
            model = next(s for s in status.servers if s.name == "policy_model")
            assert model.held_by == restore_id
            # way out 1: the id's resume runs the servers on as they were
            outcome = await coord.resume(restore_id)
            assert "policy_model" in outcome.servers
            await assert_all_accepting(http, used)
    # way out 2: freshly started servers take the same snapshot
    with make_cluster(None) as fresh:
        async with Coordinator.open(configure(fresh, ledger_url)) as coord:
            await coord.discover()
            restored = await coord.restore(saved.snapshot, resume=True)
            assert restored.source_checkpoint_id == saved.snapshot.name
        async with httpx.AsyncClient() as http:
            await assert_all_accepting(http, fresh)
