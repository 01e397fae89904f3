"""v1's rollout lineage in the ledger (issue 38): what a save captured, what the trainer
acknowledged, what a restore continues — against real uvicorn gymsim servers and a real SQLite ledger.

- A mid-rollout save records `rollouts.captured`: per agent, the (rollout id, attempt) of each row
  of its `continuations.jsonl` in the published snapshot (an agent with none: an empty list), before
  the commit phase completes; an index whose records are not continuation rows fails the commit at
  that agent, before the model is called, and nothing is captured.
- An acknowledgement records `rollouts.acknowledged` (the agent as `server`, no checkpoint id) with
  the set the agent acknowledged — by pairs or by receipts — on disk when it returns; a refused
  one records nothing.
- A restore records `rollouts.continued` once its restore phase succeeded, before any server is
  resumed: what it continues (`attempt.resubmit`), what it discarded (`attempt.restart`, a
  continuation on a `restart_only` server), the agents whose folder does not say
  (`attempt.resubmit_unknown`) — once per restore, also when a resume restores a restarted server
  again, and when recovery re-drives a restore a dead coordinator left.
- Gym's unified plane records none of them (its lineage is its `episodes.*` events).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator import ClusterConfig, Coordinator, PhaseError, Resubmission, parse_config
from quiesce.coordinator.errors import AcknowledgementError
from quiesce.coordinator.protocol import AGENT as AGENT_COMPONENT
from quiesce.coordinator.protocol import AGENT_CONTINUATIONS, agent_instance_dir, route
from quiesce.ledger import Event
from quiesce.tools.audit.attempts import build_attempt
from quiesce.tools.gymsim import client
from quiesce.tools.gymsim.agent import Rollout
from quiesce.tools.gymsim.cluster import RunningCluster, start_cluster
from quiesce.tools.gymsim.spec import SpecLike, default_v2_spec
from quiesce.tools.gymsim.v2.trainer import Trainer, make_tasks
from tests.coordinator.helpers import assert_protocol_ok, control_logs, read_events, server_states
from tests.hostile.test_restore_continuations import RESTART_ONLY, _copied, _rename_a_record
from tests.recovery.conftest import die_after
from tests.recovery.helpers import Died, kind_is

__all__ = ["die_after"]

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

MakeCluster = Callable[[SpecLike], AbstractContextManager[RunningCluster]]
AGENT = "simple_agent"
ROLLOUTS = {f"r{i}": 8 for i in range(3)}
V1_KINDS = ("rollouts.captured", "rollouts.acknowledged", "rollouts.continued")

#: the seed's example with a second stateful agent that runs nothing: it parks no rollout
TWO_AGENTS = {
    "servers": [
        {"kind": "model", "name": "policy_model"},
        {"kind": "model", "name": "judge", "instance_role": "auxiliary"},
        {"kind": "agent", "name": AGENT, "policy": "policy_model", "resources": "tools"},
        {"kind": "agent", "name": "idle_agent", "policy": "policy_model"},
        {"kind": "resources", "name": "tools", "judge": "judge"},
    ]
}


def _pairs(items: Sequence[Any]) -> list[tuple[str, int]]:
    """`(rollout_id, attempt)` of each `{"rollout_id", "attempt"}` of a `rollouts.*` list."""
    return [(item["rollout_id"], item["attempt"]) for item in items]


def _by_agent(executions: Sequence[Resubmission]) -> dict[str, list[tuple[str, int]]]:
    out: dict[str, list[tuple[str, int]]] = {}
    for r in executions:
        out.setdefault(r.server, []).append((r.rollout_id, r.attempt_index))
    return out


def _of(events: Sequence[Event], kind: str) -> list[Event]:
    return [ev for ev in events if ev.kind == kind]


def _phase_end(events: Sequence[Event], phase: str) -> Event:
    [end] = [ev for ev in events if ev.kind == "phase.completed" and ev.data["phase"] == phase]
    return end


def _index_rows(snapshot: Path, agent: str) -> list[tuple[str, int]]:
    """`(rollout_id, attempt_index)` of each row of an agent's published `continuations.jsonl`."""
    data = (snapshot / agent_instance_dir(agent) / AGENT_CONTINUATIONS).read_text()
    rows = [json.loads(line) for line in data.splitlines() if line.strip()]
    return [(row["rollout_id"], row["attempt_index"]) for row in rows]


async def _mid_rollout(http: httpx.AsyncClient, running: RunningCluster, rollouts: dict[str, int]) -> None:
    for name in ("policy_model", "tools"):
        await http.post(f"{running.urls[name]}/gymsim/admin/options", json={"latency_s": 0.1})
    await client.start_rollouts(http, running.urls[AGENT], rollouts)
    await client.wait_turns(http, running.urls[AGENT], 2)


async def _snapshot(make_cluster: MakeCluster, configure: Any, ledger: str, spec: SpecLike = None) -> Path:
    """A snapshot taken mid-rollout (its rollouts parked at a turn boundary)."""
    with make_cluster(spec) as running:
        config = configure(running, ledger)
        async with httpx.AsyncClient(timeout=30) as http, Coordinator.open(config) as coord:
            await coord.discover()
            await _mid_rollout(http, running, ROLLOUTS)
            attempt = await coord.checkpoint(deadline_s=30)
    assert attempt.snapshot is not None
    return attempt.snapshot


# -- rollouts.captured ----------------------------------------------------------------------------


async def test_a_mid_rollout_save_records_the_rows_of_each_agents_continuation_index(
    make_cluster: MakeCluster, sqlite_url: str, configure: Any
) -> None:
    with make_cluster(TWO_AGENTS) as running:
        async with httpx.AsyncClient(timeout=30) as http:
            async with Coordinator.open(configure(running, sqlite_url)) as coord:
                await coord.discover()
                await _mid_rollout(http, running, ROLLOUTS)
                attempt = await coord.checkpoint(deadline_s=30)
            rollouts = await client.get_rollouts(http, running.urls[AGENT])
    assert any(r["status"] != "completed" for r in rollouts.values()), "the save was not mid-rollout"
    assert attempt.snapshot is not None
    events = await read_events(sqlite_url, attempt.checkpoint_id)
    [captured] = _of(events, "rollouts.captured")
    rows = _index_rows(attempt.snapshot, AGENT)
    assert rows  # parked with a boundary: a row each
    assert {name: _pairs(pairs) for name, pairs in captured.data["captured"].items()} == {
        AGENT: rows,
        "idle_agent": _index_rows(attempt.snapshot, "idle_agent"),
    }
    assert captured.data["captured"]["idle_agent"] == []  # an agent with no row is listed, empty
    assert (captured.server, captured.checkpoint_id) == (None, attempt.checkpoint_id)
    # after the last commit call's outcome, before the commit phase completed
    commits = {ev.call_id for ev in events if ev.kind == "call.sent" and ev.data["phase"] == "commit"}
    answered = [ev.seq for ev in events if ev.kind == "call.replied" and ev.call_id in commits]
    assert len(answered) == 4  # two agents, the policy model, the resources server
    assert max(answered) < captured.seq < _phase_end(events, "commit").seq
    # `quiesce show` (the attempt's view) lists it, agents in attempt order
    view = build_attempt(attempt.checkpoint_id, events)
    assert view.rollouts is not None
    assert view.rollouts.captured == {AGENT: tuple(rows), "idle_agent": ()}
    assert view.to_json()["rollouts"]["captured"][AGENT] == [{"rollout_id": r, "attempt": a} for r, a in rows]
    await assert_protocol_ok(sqlite_url)


async def test_a_continuation_index_that_is_not_rows_fails_the_commit_at_its_agent(
    make_cluster: MakeCluster, sqlite_url: str, configure: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the agent writes rows without a capture key: the file's bytes, sha256 and record count
    # agree with its reply, only its content is not continuation rows
    original = Rollout.continuation_row

    def no_capture_key(self: Rollout) -> dict[str, Any]:
        row = original(self)
        del row["capture_key"]
        return row

    monkeypatch.setattr(Rollout, "continuation_row", no_capture_key)
    with make_cluster(None) as running:
        async with httpx.AsyncClient(timeout=30) as http:
            async with Coordinator.open(configure(running, sqlite_url)) as coord:
                await coord.discover()
                await _mid_rollout(http, running, ROLLOUTS)
                with pytest.raises(PhaseError) as caught:
                    await coord.checkpoint(deadline_s=30)
            logs = await control_logs(http, running)
    failed = caught.value
    assert (failed.phase, failed.server) == ("commit", AGENT)
    assert "not a continuation row" in failed.reason
    assert "capture_key" in failed.reason
    # the model was never given that index: its commit was not sent
    assert [e["path"] for e in logs["policy_model"] if e["path"].endswith("/commit")] == []
    assert [e["path"] for e in logs[AGENT] if e["path"].endswith("/commit")] != []
    events = await read_events(sqlite_url, failed.checkpoint_id)
    assert _of(events, "rollouts.captured") == []
    assert len(_of(events, "attempt.aborted")) == 1  # rolled back like any other bad file


# -- rollouts.acknowledged ------------------------------------------------------------------------


@pytest.mark.parametrize("acknowledgement", ["pair", "receipt"])
async def test_an_acknowledgement_records_what_the_agent_acknowledged(
    make_cluster: MakeCluster, sqlite_url: str, configure: Any, acknowledgement: str
) -> None:
    document: dict[str, Any] = json.loads(json.dumps(TWO_AGENTS))
    for server in document["servers"]:
        if server["name"] == AGENT:
            server["acknowledgement"] = acknowledgement
    with make_cluster(document) as running:
        agent = running.urls[AGENT]
        async with httpx.AsyncClient(timeout=60) as http:
            await http.post(f"{running.urls['policy_model']}/gymsim/admin/options", json={"latency_s": 0.001})
            await client.start_rollouts(http, agent, {"b": 1, "a": 1, "c": 1})
            await client.wait_finished(http, agent, expect=3)
            async with Coordinator.open(configure(running, sqlite_url)) as coord:
                await coord.discover()
                with pytest.raises(AcknowledgementError):
                    await coord.acknowledge_completed(AGENT, [("never", 0)])
                assert await coord.acknowledge_completed(AGENT, [("b", 0), ("a", 0)]) == [("b", 0), ("a", 0)]
                # on disk when it returns: another reader sees it while this coordinator is open
                recorded = _of(await read_events(sqlite_url), "rollouts.acknowledged")
                assert len(recorded) == 1
                assert await coord.acknowledge_completed(AGENT, [("c", 0)]) == [("c", 0)]
            views = await client.get_rollouts(http, agent)
    assert all(views[r]["acknowledged"] for r in ("a", "b", "c"))
    events = await read_events(sqlite_url)
    acknowledged = _of(events, "rollouts.acknowledged")
    assert [(ev.server, ev.checkpoint_id) for ev in acknowledged] == [(AGENT, None), (AGENT, None)]
    assert [sorted(_pairs(ev.data["executions"])) for ev in acknowledged] == [
        [("a", 0), ("b", 0)],
        [("c", 0)],
    ]
    # each after its acknowledge call's answer (a refused one, and a 422 to the pairs, record none)
    replies = {ev.call_id: ev for ev in events if ev.kind in ("call.replied", "call.failed")}
    answered = [
        replies[ev.call_id]
        for ev in events
        if ev.kind == "call.sent"
        and ev.data["path"] == route(AGENT_COMPONENT, "acknowledge").full_path
        and replies[ev.call_id].kind == "call.replied"
        and replies[ev.call_id].data["status"] == 200
    ]
    assert len(answered) == 2
    assert all(reply.seq < ev.seq for reply, ev in zip(answered, acknowledged, strict=True))
    assert answered[1].seq > acknowledged[0].seq
    await assert_protocol_ok(sqlite_url)


# -- rollouts.continued ---------------------------------------------------------------------------


async def test_a_restore_records_what_it_continues_once_even_when_a_server_is_restored_again(
    make_cluster: MakeCluster, sqlite_url: str, configure: Any
) -> None:
    snapshot = await _snapshot(make_cluster, configure, sqlite_url)
    with make_cluster(None) as fresh:
        async with httpx.AsyncClient(timeout=30) as http:
            async with Coordinator.open(configure(fresh, sqlite_url)) as coord:
                attempt = await coord.restore(snapshot)
                assert attempt.resubmit
                # the agent restarts before the resume: the resume restores it again, same id
                await client.restart(http, fresh.urls[AGENT])
                outcome = await coord.resume()
            assert outcome.restored_again == (AGENT,)
    events = await read_events(sqlite_url, attempt.checkpoint_id)
    [continued] = _of(events, "rollouts.continued")  # once, though the restore phase ran twice
    assert len([ev for ev in events if ev.kind == "phase.completed" and ev.data["phase"] == "restore"]) == 2
    data = continued.data
    assert data["source_checkpoint_id"] == snapshot.name
    assert {n: _pairs(p) for n, p in data["continued"].items()} == _by_agent(attempt.resubmit)
    assert (data["discarded"], data["unknown"]) == ({}, {})
    first_restore_end = min(
        ev.seq for ev in events if ev.kind == "phase.completed" and ev.data["phase"] == "restore"
    )
    last_restore_call = max(
        ev.seq for ev in events if ev.kind == "call.sent" and ev.data.get("phase") == "restore"
    )
    assert continued.seq < first_restore_end
    resumes = [
        ev.seq for ev in events if ev.kind == "call.sent" and ev.data.get("path", "").endswith("/resume")
    ]
    assert continued.seq < min(resumes)  # committed before any server was resumed
    assert last_restore_call > continued.seq  # the second run of the phase appended none
    view = build_attempt(attempt.checkpoint_id, events)
    assert view.rollouts is not None
    assert view.rollouts.continued_from == snapshot.name
    assert view.rollouts.continued == {n: tuple(p) for n, p in _by_agent(attempt.resubmit).items()}
    await assert_protocol_ok(sqlite_url)


async def test_a_restore_records_the_continuations_it_discarded(
    make_cluster: MakeCluster, sqlite_url: str, configure: Any
) -> None:
    snapshot = await _snapshot(make_cluster, configure, sqlite_url, RESTART_ONLY)
    with make_cluster(RESTART_ONLY) as fresh:
        async with Coordinator.open(configure(fresh, sqlite_url)) as coord:
            attempt = await coord.restore(snapshot, resume=True)
    assert attempt.restart  # every saved turn on the restart_only server: started afresh
    [continued] = _of(await read_events(sqlite_url, attempt.checkpoint_id), "rollouts.continued")
    data = continued.data
    assert {n: _pairs(p) for n, p in data["discarded"].items()} == _by_agent(attempt.restart)
    assert {n: _pairs(p) for n, p in data["continued"].items() if p} == _by_agent(attempt.resubmit)
    assert set(data["continued"]) == {AGENT}
    assert not {tuple(p) for p in data["continued"][AGENT]} & {
        (r.rollout_id, r.attempt_index) for r in attempt.restart
    }
    await assert_protocol_ok(sqlite_url)


async def test_an_agent_whose_saved_folder_does_not_say_is_recorded_unknown(
    make_cluster: MakeCluster, tmp_path: Path, configure: Any
) -> None:
    first_ledger = f"sqlite+aiosqlite:///{tmp_path / 'a.db'}"
    snapshot = await _snapshot(make_cluster, configure, first_ledger)
    copied = _copied(snapshot, tmp_path)
    where = _rename_a_record(copied)
    with make_cluster(None) as fresh:
        document = fresh.config(f"sqlite+aiosqlite:///{tmp_path / 'b.db'}", tmp_path / "copied")
        config: ClusterConfig = parse_config(document, base_dir=tmp_path)
        async with Coordinator.open(config) as coord:
            attempt = await coord.restore(copied)
            await coord.resume()
    assert [u.server for u in attempt.resubmit_unknown] == [AGENT]
    [continued] = _of(await read_events(config.ledger, attempt.checkpoint_id), "rollouts.continued")
    assert continued.data["unknown"] == {AGENT: attempt.resubmit_unknown[0].reason}
    assert where in continued.data["unknown"][AGENT]
    assert continued.data["continued"] == {}  # an agent that does not say is not listed as continuing none
    await assert_protocol_ok(config.ledger)


async def test_a_restore_redriven_by_recovery_records_what_it_continues_once(
    make_cluster: MakeCluster, sqlite_url: str, configure: Any, die_after: Any
) -> None:
    snapshot = await _snapshot(make_cluster, configure, sqlite_url)
    with make_cluster(None) as fresh:
        config = configure(fresh, sqlite_url)
        # the coordinator dies once the agent's restore answered, before the phase completed
        die_after(kind_is("call.replied", server=AGENT), nth=2)  # discovery, restore
        with pytest.raises(Died):
            async with Coordinator.open(config) as coord:
                await coord.restore(snapshot)
        before = await read_events(sqlite_url)
        [started] = [ev for ev in before if ev.kind == "attempt.started" and ev.data["kind"] == "restore"]
        cid = started.checkpoint_id
        assert cid is not None
        assert _of(await read_events(sqlite_url, cid), "rollouts.continued") == []
        async with Coordinator.open(config) as coord:  # recovery re-drives the restore phase
            report = coord.last_recovery
            assert report is not None
            async with httpx.AsyncClient(timeout=30) as http:
                assert (await server_states(http, fresh))[AGENT][0] == "restored_paused"
            outcome = await coord.resume()
        async with Coordinator.open(config) as coord:  # nothing left to recover: nothing appended
            assert coord.last_recovery is not None
    events = await read_events(sqlite_url, cid)
    [continued] = _of(events, "rollouts.continued")
    resubmit = report.attempts[0].resubmit
    assert resubmit == outcome.resubmit
    assert {n: _pairs(p) for n, p in continued.data["continued"].items()} == _by_agent(resubmit)
    assert continued.epoch > started.epoch  # appended by the coordinator that finished it
    assert continued.seq < _phase_end(events, "restore").seq
    await assert_protocol_ok(sqlite_url)


# -- the unified plane --------------------------------------------------------------------------------


async def test_the_unified_plane_records_none_of_them(token: str, sqlite_url: str, tmp_path: Path) -> None:
    def config_of(running: RunningCluster) -> ClusterConfig:
        return parse_config(running.config(sqlite_url, tmp_path / "snapshots"), base_dir=tmp_path)

    tasks = make_tasks(3, turns=4)
    spec = default_v2_spec().model_dump(mode="json")
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        with start_cluster(spec, token=token) as first:
            trainer = Trainer(first.urls["environment"], http=http)
            await trainer.start(tasks, paced=True)
            await trainer.advance(2, ["r0", "r1", "r2"])
            await trainer.wait_parked()
            async with Coordinator.open(config_of(first)) as coord:
                attempt = await coord.checkpoint(deadline_s=20)
            await trainer.detach()
        with start_cluster(spec, token=token) as second:
            async with Coordinator.open(config_of(second)) as coord:
                restored = await coord.restore(attempt.snapshot, resume=True)
    assert restored.resubmit  # it continued episodes: its lineage is recorded, as episodes
    kinds = {ev.kind for ev in await read_events(sqlite_url)}
    assert {"episodes.exported", "episodes.restored"} <= kinds
    assert kinds.isdisjoint(V1_KINDS)
