"""A server restarted between a restore and its resume is restored again before anyone is resumed.

Gym's fence lives in the process: a restarted agent or resources server comes back `idle`, holding
nothing of the snapshot, and accepts a resume from `idle`; a restarted model answers it 409
`invalid_phase`. Either way a plain resume would run it empty beside servers that run the restored
state. The resume of a restore reads the fences of the servers not yet resumed, restores again
(same id, snapshot verified again) each one that holds nothing of it, and only then resumes —
or, when that cannot be done, resumes nobody. Real uvicorn gymsim servers; a restart replaces the
server behind its port by a fresh one (`POST /gymsim/admin/restart`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator import Coordinator, PhaseError
from quiesce.tools.gymsim import client
from tests.coordinator.helpers import (
    assert_all_accepting,
    assert_protocol_ok,
    control_log,
    read_events,
    server_states,
    set_faults,
)
from tests.coordinator.test_restore import _checkpoint_mid_rollout, _saved_records, _uninterrupted

pytestmark = pytest.mark.anyio


def _restores(log: list[dict[str, Any]], checkpoint_id: str) -> int:
    return sum(1 for e in log if e["path"].endswith("/restore") and e["checkpoint_id"] == checkpoint_id)


async def _waiting(http: httpx.AsyncClient, agent: str) -> dict[str, tuple[str, int, int]]:
    """rollout → (status, attempt index, turns done) as the agent holds it now."""
    views = await client.get_rollouts(http, agent)
    return {rid: (v["status"], v["attempt_index"], v["turns_done"]) for rid, v in views.items()}


async def test_an_agent_and_a_resources_server_restarted_after_the_restore_are_restored_again(
    make_cluster: Any, sqlite_url: str, configure: Any
) -> None:
    expected = await _uninterrupted(make_cluster)
    with make_cluster(None) as first:
        snapshot = await _checkpoint_mid_rollout(first, configure(first, sqlite_url))
    saved = _saved_records(snapshot)
    restored_view = {rid: ("restored", n + 1, turns) for (rid, n), turns in saved.items()}
    with make_cluster(None) as second:
        agent = second.urls["simple_agent"]
        async with httpx.AsyncClient() as http, Coordinator.open(configure(second, sqlite_url)) as coord:
            await coord.discover()
            attempt = await coord.restore(snapshot)
            assert await _waiting(http, agent) == restored_view
            await client.restart(http, agent)
            await client.restart(http, second.urls["tools"])
            states = await server_states(http, second)
            assert states["simple_agent"] == ("idle", "accepting")  # a fresh process: nothing restored
            assert states["tools"] == ("idle", "accepting")
            assert await _waiting(http, agent) == {}
            outcome = await coord.resume()
            assert outcome.outcome == "resumed"
            assert set(outcome.restored_again) == {"simple_agent", "tools"}
            assert outcome.as_json()["restored_again"] == list(outcome.restored_again)
            assert outcome.resumed == ("tools", "policy_model", "simple_agent")
            assert _restores(await control_log(http, agent), attempt.checkpoint_id) == 1  # the new process's
            await assert_all_accepting(http, second)
            assert await _waiting(http, agent) == restored_view  # the restored state is back
            await client.resubmit(http, agent, outcome.resubmit)
            rollouts = await client.wait_finished(http, agent, timeout_s=60)
    assert client.final_results(rollouts) == expected
    assert client.turn_log_problems(rollouts) == []
    events = await read_events(sqlite_url, attempt.checkpoint_id)
    runs = [ev for ev in events if ev.kind == "phase.started" and ev.data["phase"] == "restore"]
    assert len(runs) == 2
    assert runs[0].data["deadline_ts"] is None  # the first run works to the attempt's deadline
    assert runs[1].data["deadline_ts"] > attempt.deadline_ts - 1  # the second to its own, recorded
    again = [
        ev.server
        for ev in events
        if ev.kind == "call.sent" and ev.seq > runs[1].seq and str(ev.data["path"]).endswith("/restore")
    ]
    assert again == ["simple_agent", "tools"]  # only the restarted ones, in restore order
    await assert_protocol_ok(sqlite_url)


async def test_a_restarted_model_is_restored_again_by_a_later_coordinator(
    make_cluster: Any, sqlite_url: str, configure: Any
) -> None:
    """The model answers a resume from `idle` 409 `invalid_phase`, which a plain resume takes for
    "never paused". The resume here runs in another coordinator, from the ledger alone."""
    with make_cluster(None) as first:
        snapshot = await _checkpoint_mid_rollout(first, configure(first, sqlite_url))
    with make_cluster(None) as second:
        config = configure(second, sqlite_url)
        model = second.urls["policy_model"]
        async with httpx.AsyncClient() as http:
            async with Coordinator.open(config) as coord:
                await coord.discover()
                attempt = await coord.restore(snapshot)
            await client.restart(http, model)
            assert (await server_states(http, second))["policy_model"] == ("idle", "accepting")
            async with Coordinator.open(config, recover=False) as later:  # as `quiesce resume ID`
                outcome = await later.resume(attempt.checkpoint_id)
            assert outcome.outcome == "resumed"
            assert outcome.restored_again == ("policy_model",)
            assert "policy_model" in outcome.resumed  # resumed from what it restored, not "never paused"
            assert outcome.resubmit == attempt.resubmit
            log = await control_log(http, model)
            ops = [e["path"].rsplit("/", 1)[-1] for e in log if e["checkpoint_id"] == attempt.checkpoint_id]
            assert [op for op in ops if op != "capabilities"] == ["restore", "resume"]
            await assert_all_accepting(http, second)
    await assert_protocol_ok(sqlite_url)


async def test_no_server_is_resumed_when_a_restarted_one_cannot_be_restored_again(
    make_cluster: Any, sqlite_url: str, configure: Any, tmp_path: Path
) -> None:
    with make_cluster(None) as first:
        snapshot = await _checkpoint_mid_rollout(first, configure(first, sqlite_url))
    with make_cluster(None) as second:
        agent = second.urls["simple_agent"]
        async with httpx.AsyncClient() as http, Coordinator.open(configure(second, sqlite_url)) as coord:
            await coord.discover()
            attempt = await coord.restore(snapshot)
            await client.restart(http, agent)
            aside = tmp_path / "aside"
            snapshot.rename(aside)  # the snapshot is gone: nothing to restore the agent from
            with pytest.raises(PhaseError) as caught:
                await coord.resume()
            error = caught.value
            assert error.server == "simple_agent"
            assert "restarted since the restore" in str(error)
            assert str(snapshot) in str(error)  # what is missing
            assert f"{attempt.checkpoint_id}` again" in str(error)  # and what to run then
            assert set(error.not_resumed) == {"policy_model", "simple_agent", "tools"}
            states = await server_states(http, second)
            assert states["policy_model"][0] == "restored_paused"  # nobody runs: the others stay paused
            assert states["tools"][0] == "restored_paused"
            assert states["simple_agent"][0] == "idle"
            assert not any(
                e["path"].endswith("/resume") for e in await control_log(http, second.urls["tools"])
            )
            aside.rename(snapshot)  # put back: the same id's resume now finishes
            outcome = await coord.resume(attempt.checkpoint_id)
            assert outcome.outcome == "resumed"
            assert outcome.restored_again == ("simple_agent",)
            assert await _waiting(http, agent) == {
                rid: ("restored", n + 1, turns) for (rid, n), turns in _saved_records(snapshot).items()
            }
            await assert_all_accepting(http, second)
    kinds = [ev.kind for ev in await read_events(sqlite_url, attempt.checkpoint_id)]
    assert kinds.count("phase.failed") == 1
    await assert_protocol_ok(sqlite_url)


async def _resume_failing_at_the_agent(
    http: httpx.AsyncClient, config: Any, agent: str, snapshot: Path, fault: dict[str, Any]
) -> str:
    """Restore `snapshot`, then resume with `fault` on the agent's resume: tools and the model are
    resumed, the agent is left paused (its resume refused, or its reply lost). The restore's id."""
    async with Coordinator.open(config) as coord:
        await coord.discover()
        attempt = await coord.restore(snapshot)
        await set_faults(http, agent, [{"path": "/agent-checkpoint/resume", "times": 1, **fault}])
        with pytest.raises(PhaseError) as caught:
            await coord.resume()
        assert caught.value.not_resumed == ["simple_agent"]
    return attempt.checkpoint_id


async def test_servers_resumed_before_are_not_restored_again(
    make_cluster: Any, sqlite_url: str, configure: Any
) -> None:
    """A resume that stopped half-way: the servers it resumed run (idle, the id retired) and must
    not be taken for restarted ones — a later coordinator reads that from the ledger."""
    with make_cluster(None) as first:
        snapshot = await _checkpoint_mid_rollout(first, configure(first, sqlite_url))
    with make_cluster(None) as second:
        config = configure(second, sqlite_url, control_timeout_s=1)
        agent = second.urls["simple_agent"]
        async with httpx.AsyncClient() as http:
            cid = await _resume_failing_at_the_agent(
                http, config, agent, snapshot, {"kind": "fail", "status": 503}
            )
            states = await server_states(http, second)
            assert states["tools"] == ("idle", "accepting")
            assert states["policy_model"] == ("idle", "accepting")
            async with Coordinator.open(config, recover=False) as later:  # as `quiesce resume ID`
                outcome = await later.resume(cid)
            assert outcome.outcome == "resumed"
            assert outcome.restored_again == ()
            for name in ("tools", "policy_model", "simple_agent"):
                assert _restores(await control_log(http, second.urls[name]), cid) == 1
            await assert_all_accepting(http, second)
            assert await _waiting(http, agent) == {
                rid: ("restored", n + 1, turns) for (rid, n), turns in _saved_records(snapshot).items()
            }
    await assert_protocol_ok(sqlite_url)


async def test_a_server_whose_resume_reply_was_lost_is_not_restored_again(
    make_cluster: Any, sqlite_url: str, configure: Any
) -> None:
    """The agent resumed, but its reply never arrived: the ledger cannot tell it from a restart
    (idle, no reply recorded). Its fence can: the id is retired there, so the restore sent to find
    out is refused `stale_checkpoint` — it runs the restored state — and it is only resumed."""
    with make_cluster(None) as first:
        snapshot = await _checkpoint_mid_rollout(first, configure(first, sqlite_url))
    restored_view = {rid: ("restored", n + 1, turns) for (rid, n), turns in _saved_records(snapshot).items()}
    with make_cluster(None) as second:
        config = configure(second, sqlite_url, control_timeout_s=1)
        agent = second.urls["simple_agent"]
        async with httpx.AsyncClient() as http:
            cid = await _resume_failing_at_the_agent(http, config, agent, snapshot, {"kind": "drop"})
            assert (await server_states(http, second))["simple_agent"] == ("idle", "accepting")
            async with Coordinator.open(config, recover=False) as later:
                outcome = await later.resume(cid)
            assert outcome.outcome == "resumed"
            assert outcome.restored_again == ()
            assert "simple_agent" in outcome.resumed
            log = [e for e in await control_log(http, agent) if e["checkpoint_id"] == cid]
            assert [
                (e["path"].rsplit("/", 1)[-1], e["status"]) for e in log if e["path"].endswith("/restore")
            ] == [
                ("restore", 200),
                ("restore", 409),  # stale_checkpoint: the id is retired there, nothing changed
            ]
            assert await _waiting(http, agent) == restored_view
            await assert_all_accepting(http, second)
    await assert_protocol_ok(sqlite_url)
