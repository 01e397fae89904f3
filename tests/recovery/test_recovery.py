"""Recovery, branch by branch, against real reference servers and a real ledger.

Each case publishes a first snapshot, starts rollouts, lets a coordinator die at one instant
(`die_after`: the next coordinator stops dead right after that append, recording nothing more),
then opens a new coordinator — recovery runs at open — and checks: what recovery reported and
recorded (`recovery.settled` per server, the attempt's terminal event, the projection), that
every server is idle and accepting (or restored and paused, for a restore), the snapshots on disk,
the audit's independent protocol check, and that rollouts finish with no turn lost or run twice.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator import (
    ClusterConfig,
    ConfigError,
    Coordinator,
    Resubmission,
    load_config,
    load_snapshot,
    read_latest,
    verify_snapshot,
)
from quiesce.coordinator.protocol import RESOURCES, route
from quiesce.coordinator.publish import rename_into_place
from quiesce.coordinator.recovery import RecoveryReport
from quiesce.ledger import Event, Ledger
from quiesce.tools.cli.main import main as cli
from quiesce.tools.gymsim import client
from tests.coordinator.helpers import (
    assert_all_accepting,
    assert_protocol_ok,
    control_logs,
    read_events,
    server_states,
    set_faults,
)
from tests.recovery.helpers import Died, kind_is

pytestmark = pytest.mark.anyio

#: Long enough to be mid-rollout when a checkpoint prepares: a finished one is held until acknowledged.
ROLLOUTS = {f"r{i}": 60 for i in range(3)}


async def _first_snapshot(config: ClusterConfig) -> Path:
    async with Coordinator.open(config) as coord:
        attempt = await coord.checkpoint(deadline_s=30)
    assert attempt.snapshot is not None
    return attempt.snapshot


async def _start(http: httpx.AsyncClient, running: Any) -> None:
    for name in ("policy_model", "tools"):
        await http.post(f"{running.urls[name]}/gymsim/admin/options", json={"latency_s": 0.01})
    await client.start_rollouts(http, running.urls["simple_agent"], ROLLOUTS)
    await client.wait_turns(http, running.urls["simple_agent"], 1)


async def _unfinished_checkpoint_id(config: ClusterConfig) -> str:
    """The checkpoint id of the one attempt the dead coordinator left unfinished."""
    async with Ledger.open(config.ledger, readonly=True) as ledger:
        rows = [row for row in await ledger.attempts() if row.outcome is None]
    assert len(rows) == 1, rows
    return rows[0].checkpoint_id


async def _die_during_checkpoint(config: ClusterConfig) -> str:
    """Run a checkpoint that the armed `die_after` kills; return the attempt's checkpoint id."""
    with pytest.raises(Died):
        async with Coordinator.open(config) as coord:
            await coord.checkpoint(deadline_s=30)
    return await _unfinished_checkpoint_id(config)


async def _die_at_the_rename(config: ClusterConfig, monkeypatch: pytest.MonkeyPatch, *, renamed: bool) -> str:
    """Run a checkpoint whose coordinator dies at its snapshot's rename — just before it, or just
    after it (`renamed`) — and commits nothing more: the publish step's records, staged and not
    yet committed, are lost, as a SIGKILL there loses them. Returns the attempt's checkpoint id."""

    def rename(staging: Path, final: Path, identity: tuple[int, int] | None = None) -> None:
        if renamed:
            rename_into_place(staging, final, identity)
        raise Died(f"simulated coordinator death {'after' if renamed else 'before'} renaming {staging}")

    async def commit_nothing() -> None:
        return None

    async def checkpoint() -> None:
        async with Coordinator.open(config) as coord:
            patch.setattr(coord.ledger, "flush", commit_nothing)  # a dead process commits nothing more
            await coord.checkpoint(deadline_s=30)

    with monkeypatch.context() as patch:
        patch.setattr("quiesce.coordinator.save.rename_into_place", rename)
        with pytest.raises(Died):
            await checkpoint()
    return await _unfinished_checkpoint_id(config)


async def _recover(config: ClusterConfig) -> RecoveryReport:
    async with Coordinator.open(config) as coord:
        report = coord.last_recovery
    assert report is not None
    return report


def _settled(events: list[Event]) -> dict[str, dict[str, Any]]:
    return {str(ev.server): ev.data for ev in events if ev.kind == "recovery.settled"}


async def _finish_rollouts(http: httpx.AsyncClient, running: Any) -> None:
    rollouts = await client.wait_finished(http, running.urls["simple_agent"], timeout_s=60)
    assert client.turn_log_problems(rollouts) == []
    assert all(r["status"] == "completed" for r in rollouts.values())


async def test_death_after_prepare_resumes_every_touched_server(
    cluster: Any, sqlite_url: str, configure: Any, die_after: Any
) -> None:
    config = configure(cluster, sqlite_url)
    previous = await _first_snapshot(config)
    # `phase.completed prepare` is staged: it commits with the first commit request's call.sent,
    # and the coordinator dies right then, before that request leaves
    die_after(kind_is("phase.completed", phase="prepare"))
    async with httpx.AsyncClient() as http:
        await _start(http, cluster)
        cid = await _die_during_checkpoint(config)
        states = await server_states(http, cluster)
        assert states["policy_model"] == ("prepared", "paused")
        assert states["simple_agent"][0] == "prepared"  # the commit never reached it
        report = await _recover(config)
        await assert_all_accepting(http, cluster)
        await _finish_rollouts(http, cluster)
    assert [a.checkpoint_id for a in report.attempts] == [cid]
    found = report.attempts[0]
    assert (found.found, found.action) == ("commit", "resumed")
    assert [(s.name, s.reported_phase, s.result) for s in found.servers] == [
        ("tools", "prepared", "resumed"),
        ("policy_model", "prepared", "resumed"),
        ("simple_agent", "prepared", "resumed"),
    ]
    events = await read_events(sqlite_url, cid)
    assert set(_settled(events)) == {"tools", "policy_model", "simple_agent"}
    assert events[-1].kind == "attempt.aborted"
    assert events[-1].data["left_paused"] == []
    async with Ledger.open(sqlite_url, readonly=True) as ledger:
        row = await ledger.attempt(cid)
    assert row is not None
    assert (row.outcome, row.recovered_by) == ("aborted", row.epoch + 1)
    assert read_latest(config.snapshots) == previous
    assert not (config.staging_root / cid).exists()
    await assert_protocol_ok(sqlite_url)


def _power_loss_after(
    monkeypatch: pytest.MonkeyPatch, dies_after: Any, sqlite_url: str, tmp_path: Path
) -> str:
    """Arm the next coordinator to die after `dies_after`, and return the URL of the ledger a power
    failure would leave: a copy of its SQLite file taken the instant the durable transaction that
    carries the dying attempt's `attempt.started` committed (nothing later is fsynced before the
    death)."""
    import sqlite3

    from quiesce.coordinator import crashpoints
    from tests.recovery.helpers import Dying

    prefix = tmp_path / "on-disk-at-power-loss.db"
    source = sqlite_url.removeprefix("sqlite+aiosqlite:///")

    class PowerLoss(Dying):
        def after_append(self, events: Any) -> None:
            if any(e.kind == "attempt.started" for e in events):
                assert not prefix.exists(), "a second attempt.started before the death"
                with sqlite3.connect(source) as src, sqlite3.connect(prefix) as dst:
                    src.backup(dst)
            super().after_append(events)

    dying = PowerLoss(dies_after, 1)
    opened = {"n": 0}

    def from_env(environ: object = None) -> crashpoints.CrashPoints | None:
        opened["n"] += 1
        return dying if opened["n"] == 1 else None

    monkeypatch.setattr(crashpoints, "from_env", from_env)
    return f"sqlite+aiosqlite:///{prefix}"


@pytest.mark.parametrize(
    ("dies_after", "touched"),
    [
        # every participant prepared: each is found by what it reports (this checkpoint id active)
        (kind_is("phase.completed", phase="prepare"), ["tools", "policy_model", "simple_agent"]),
        # death before the agent's prepare left: the paused model is found by its own call (durable
        # with attempt.started); the idle agent and tools are resumed in case a prepare they
        # refused was lost (it leaves no trace)
        (
            kind_is("call.sent", server="simple_agent", phase="prepare"),
            ["tools", "policy_model", "simple_agent"],
        ),
    ],
)
async def test_power_loss_that_drops_the_write_behind_calls_still_resumes_every_touched_server(
    cluster: Any,
    sqlite_url: str,
    configure: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    dies_after: Any,
    touched: list[str],
) -> None:
    """After a power failure the ledger holds only what was fsynced: here, everything up to the
    durable transaction of the dying attempt's `attempt.started` — which carries its first request's
    `call.sent`, the model's pause — and none of its later (write-behind) calls. The next
    coordinator opens that prefix — a copy taken the instant `attempt.started` was committed — and
    must still find and resume every server the dead one touched, from their own reports."""
    config = configure(cluster, sqlite_url)
    previous = await _first_snapshot(config)
    prefix_url = _power_loss_after(monkeypatch, dies_after, sqlite_url, tmp_path)
    async with httpx.AsyncClient() as http:
        await _start(http, cluster)
        cid = await _die_during_checkpoint(config)
        kept = [(e.kind, e.server) for e in await read_events(prefix_url, cid) if e.kind.startswith("call.")]
        assert kept == [("call.sent", "policy_model")]  # every later call is gone from the prefix
        report = await _recover(config.model_copy(update={"ledger": prefix_url}))
        await assert_all_accepting(http, cluster)
        await _finish_rollouts(http, cluster)
    found = report.attempts[0]
    assert (found.checkpoint_id, found.action) == (cid, "resumed")
    assert [s.name for s in found.servers] == touched
    assert {s.result for s in found.servers} == {"resumed"}
    events = await read_events(prefix_url, cid)
    assert sorted(_settled(events)) == sorted(touched)
    aborted = events[-1]
    assert aborted.kind == "attempt.aborted"
    assert (sorted(aborted.data["resumed"]), aborted.data["left_paused"]) == (sorted(touched), [])
    assert read_latest(config.snapshots) == previous


async def test_power_loss_after_the_rename_finds_the_publication_on_disk(
    cluster: Any, sqlite_url: str, configure: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`attempt.publishing` is write-behind: a power failure after the (fsynced) rename may leave a
    ledger that ends at the attempt's durable `attempt.started`, with no trace of the publish step.
    The next coordinator looks for the snapshot folder anyway, finds it complete, and records the
    save as published (LATEST on it, every participant resumed) instead of rolling it back."""
    config = configure(cluster, sqlite_url)
    await _first_snapshot(config)
    # the first resume request's call.sent: the rename, LATEST and attempt.published are done
    prefix_url = _power_loss_after(monkeypatch, kind_is("call.sent", phase="resume"), sqlite_url, tmp_path)
    async with httpx.AsyncClient() as http:
        await _start(http, cluster)
        cid = await _die_during_checkpoint(config)
        assert load_snapshot(config.snapshots / cid).checkpoint_id == cid
        kept = [e.kind for e in await read_events(prefix_url, cid)]
        assert kept == ["attempt.started", "phase.started", "call.sent"]  # no publish step left
        report = await _recover(config.model_copy(update={"ledger": prefix_url}))
        await assert_all_accepting(http, cluster)
        await _finish_rollouts(http, cluster)
    found = report.attempts[0]
    assert (found.checkpoint_id, found.found, found.action) == (cid, "prepare", "published")
    assert [(s.name, s.result) for s in found.servers] == [
        ("tools", "resumed"),
        ("policy_model", "resumed"),
        ("simple_agent", "resumed"),
    ]
    assert read_latest(config.snapshots) == config.snapshots / cid
    kinds = [e.kind for e in await read_events(prefix_url, cid)]
    assert "attempt.publishing" not in kinds
    assert kinds.index("attempt.published") < kinds.index("attempt.completed")
    async with Ledger.open(prefix_url, readonly=True) as ledger:
        row = await ledger.attempt(cid)
    assert row is not None
    assert row.outcome == "published"
    await assert_protocol_ok(prefix_url)


async def test_request_recorded_but_never_sent_is_not_paused(
    cluster: Any, sqlite_url: str, configure: Any, die_after: Any
) -> None:
    """Death between `call.sent` of the model pause and the request: the model answers invalid_phase."""
    config = configure(cluster, sqlite_url)
    die_after(kind_is("call.sent", phase="prepare"))
    async with httpx.AsyncClient() as http:
        await _start(http, cluster)
        cid = await _die_during_checkpoint(config)
        logs = await control_logs(http, cluster)
        assert [e for e in logs["policy_model"] if e["checkpoint_id"] == cid] == []
        report = await _recover(config)
        await assert_all_accepting(http, cluster)
        await _finish_rollouts(http, cluster)
    servers = [(s.name, s.reported_phase, s.result) for s in report.attempts[0].servers]
    # the agent and tools were not touched; rolling back, recovery resumes them all the same (a
    # resume from idle only retires the id) — see the power-loss test above
    assert servers == [
        ("tools", "idle", "resumed"),
        ("policy_model", "idle", "not_paused"),
        ("simple_agent", "idle", "resumed"),
    ]
    aborted = (await read_events(sqlite_url, cid))[-1]
    assert aborted.kind == "attempt.aborted"
    assert aborted.data["not_paused"] == ["policy_model"]
    await assert_protocol_ok(sqlite_url)


async def test_death_before_the_rename_aborts_and_keeps_latest(
    cluster: Any, sqlite_url: str, configure: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest is written in the staging folder, the rename never happened: not published."""
    config = configure(cluster, sqlite_url)
    previous = await _first_snapshot(config)
    async with httpx.AsyncClient() as http:
        await _start(http, cluster)
        cid = await _die_at_the_rename(config, monkeypatch, renamed=False)
        assert (config.staging_root / cid / "manifest.json").is_file()
        kinds = [e.kind for e in await read_events(sqlite_url, cid)]
        assert kinds[-1] == "call.sent"  # the last commit request's: nothing of the publish step
        assert "attempt.publishing" not in kinds
        report = await _recover(config)
        await assert_all_accepting(http, cluster)
        await _finish_rollouts(http, cluster)
    assert (report.attempts[0].found, report.attempts[0].action) == ("commit", "resumed")
    assert not (config.staging_root / cid).exists()
    assert not (config.snapshots / cid).exists()
    assert read_latest(config.snapshots) == previous
    load_snapshot(previous)
    await assert_protocol_ok(sqlite_url)


async def test_rename_done_but_not_recorded_is_published(
    cluster: Any, sqlite_url: str, configure: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The filesystem decides: the final folder with this id's manifest means published, though
    the ledger kept nothing of the publish step (its records were staged when the process died)."""
    config = configure(cluster, sqlite_url)
    await _first_snapshot(config)
    async with httpx.AsyncClient() as http:
        await _start(http, cluster)
        cid = await _die_at_the_rename(config, monkeypatch, renamed=True)
        assert not (config.staging_root / cid).exists()
        kept = [e.kind for e in await read_events(sqlite_url, cid)]
        assert "attempt.publishing" not in kept
        assert kept[-1] == "call.sent"
        report = await _recover(config)
        await assert_all_accepting(http, cluster)
        await _finish_rollouts(http, cluster)
    found = report.attempts[0]
    assert found.action == "published"
    assert {s.result for s in found.servers} == {"resumed"}
    assert read_latest(config.snapshots) == config.snapshots / cid
    assert load_snapshot(config.snapshots / cid).checkpoint_id == cid
    kinds = [ev.kind for ev in await read_events(sqlite_url, cid)]
    assert kinds.index("attempt.published") < kinds.index("attempt.completed")
    assert kinds.count("recovery.settled") == 3
    async with Ledger.open(sqlite_url, readonly=True) as ledger:
        row = await ledger.attempt(cid)
    assert row is not None
    assert row.outcome == "published"
    await assert_protocol_ok(sqlite_url)


async def test_death_mid_resume_replays_the_resumed_server(
    cluster: Any, sqlite_url: str, configure: Any, die_after: Any
) -> None:
    """Published, then death after tools resumed: recovery resumes all; tools replays its result."""
    config = configure(cluster, sqlite_url)
    die_after(kind_is("call.replied", server="tools"), nth=4)  # discovery, prepare, commit, resume
    async with httpx.AsyncClient() as http:
        await _start(http, cluster)
        cid = await _die_during_checkpoint(config)
        states = await server_states(http, cluster)
        assert states["tools"] == ("idle", "accepting")
        assert states["policy_model"][0] == "committed_paused"
        report = await _recover(config)
        await assert_all_accepting(http, cluster)
        logs = await control_logs(http, cluster)
        await _finish_rollouts(http, cluster)
    found = report.attempts[0]
    assert (found.found, found.action) == ("resume", "published")
    assert [(s.name, s.reported_phase, s.result) for s in found.servers] == [
        ("tools", "idle", "resumed"),
        ("policy_model", "committed_paused", "resumed"),
        ("simple_agent", "committed_paused", "resumed"),
    ]
    resumes = [e for e in logs["tools"] if e["checkpoint_id"] == cid and e["path"].endswith("/resume")]
    assert len(resumes) == 2  # the dead coordinator's, and recovery's replayed one
    assert read_latest(config.snapshots) == config.snapshots / cid
    await assert_protocol_ok(sqlite_url)


async def test_server_paused_by_another_checkpoint_is_reported_not_touched(
    cluster: Any, sqlite_url: str, configure: Any, die_after: Any, token: str
) -> None:
    config = configure(cluster, sqlite_url)
    die_after(kind_is("call.sent", phase="prepare", server="tools"))
    async with httpx.AsyncClient() as http:
        await _start(http, cluster)
        cid = await _die_during_checkpoint(config)
        # someone else pauses tools with another id before recovery runs
        auth = {"Authorization": f"Bearer {token}"}
        other = {"checkpoint_id": "other-1", "deadline_ts": 4e9}
        prepare = route(RESOURCES, "prepare").full_path
        assert (await http.post(cluster.urls["tools"] + prepare, json=other, headers=auth)).status_code == 200
        report = await _recover(config)
        states = await server_states(http, cluster)
        assert states["tools"][0] == "prepared"
        assert states["policy_model"] == ("idle", "accepting")
        assert states["simple_agent"] == ("idle", "accepting")
        resume = route(RESOURCES, "resume").full_path
        assert (await http.post(cluster.urls["tools"] + resume, json=other, headers=auth)).status_code == 200
        await _finish_rollouts(http, cluster)
    tools = next(s for s in report.attempts[0].servers if s.name == "tools")
    assert (tools.reported_phase, tools.active_checkpoint_id, tools.result) == (
        "prepared",
        "other-1",
        "other_checkpoint",
    )
    settled = _settled(await read_events(sqlite_url, cid))
    assert settled["tools"]["action"] == "none"
    assert settled["tools"]["active_checkpoint_id"] == "other-1"


async def test_second_recover_makes_no_call(
    cluster: Any, sqlite_url: str, configure: Any, die_after: Any
) -> None:
    config = configure(cluster, sqlite_url)
    die_after(kind_is("phase.completed", phase="commit"))
    async with httpx.AsyncClient() as http:
        await _start(http, cluster)
        await _die_during_checkpoint(config)
        async with Coordinator.open(config, recover=False) as coord:
            first = await coord.recover()
        assert first.attempts
        assert first.ok
        before_logs = await control_logs(http, cluster)
        before = len(await read_events(sqlite_url))
        async with Coordinator.open(config, recover=False) as coord:
            second = await coord.recover()
        assert second.attempts == ()
        assert await control_logs(http, cluster) == before_logs
        await _finish_rollouts(http, cluster)
    added = [ev.kind for ev in (await read_events(sqlite_url))[before:]]
    assert added == ["coordinator.started", "recovery.started", "recovery.completed"]
    # recovery at open records nothing when there is nothing to recover
    async with Coordinator.open(config) as coord:
        assert coord.last_recovery is not None
        assert coord.last_recovery.recorded is False
    assert [ev.kind for ev in (await read_events(sqlite_url))[before + 3 :]] == ["coordinator.started"]


async def test_orphaned_staging_is_swept(cluster: Any, sqlite_url: str, configure: Any) -> None:
    config = configure(cluster, sqlite_url)
    orphan = config.staging_root / "e9-000001"
    orphan.mkdir(parents=True)
    (orphan / "junk").write_text("left by a dead coordinator")
    async with Coordinator.open(config, recover=False) as coord:
        report = await coord.recover()
    assert report.swept == ("e9-000001",)
    assert not orphan.exists()


async def test_cli_recover_json(
    cluster: Any, sqlite_url: str, configure: Any, die_after: Any, tmp_path: Path, capsys: Any
) -> None:
    config = configure(cluster, sqlite_url)
    config_file = tmp_path / "cluster.yaml"
    config_file.write_text(json.dumps(cluster.config(sqlite_url, str(config.snapshots))))
    # the agent's prepare reply (staged) commits with the tools prepare's call.sent; death there
    die_after(kind_is("call.replied", server="simple_agent"), nth=2)  # discovery, prepare
    async with httpx.AsyncClient() as http:
        await _start(http, cluster)
        cid = await _die_during_checkpoint(config)
        capsys.readouterr()
        code = await anyio.to_thread.run_sync(cli, ["recover", "--config", str(config_file), "--json"])
        document = json.loads(capsys.readouterr().out)
        await assert_all_accepting(http, cluster)
        await _finish_rollouts(http, cluster)
    assert code == 0
    assert [(a["checkpoint_id"], a["found"], a["action"]) for a in document["attempts"]] == [
        (cid, "prepare", "resumed")
    ]
    tools = {"name": "tools", "reported_phase": "idle", "result": "resumed"}  # recorded, never sent
    assert document["attempts"][0]["servers"] in (
        [
            tools,
            {"name": "policy_model", "reported_phase": phase, "result": "resumed"},
            {"name": "simple_agent", "reported_phase": "prepared", "result": "resumed"},
        ]
        for phase in ("preparing", "prepared")
    )
    code = await anyio.to_thread.run_sync(cli, ["recover", "--config", str(config_file), "--json"])
    assert (code, json.loads(capsys.readouterr().out)["attempts"]) == (0, [])


async def test_standby_needs_postgresql(cluster: Any, sqlite_url: str, configure: Any) -> None:
    config = configure(cluster, sqlite_url)
    with pytest.raises(ConfigError, match="standby needs a PostgreSQL ledger"):
        async with Coordinator.open(config, standby=True):
            pass


# -- restore ----------------------------------------------------------------------------------


async def _snapshot_mid_rollout(
    make_cluster: Any, configure: Any, ledger_url: str
) -> tuple[Path, dict[str, Any]]:
    """A snapshot taken mid-rollout, and the results of the same rollouts run uninterrupted."""
    with make_cluster(None) as plain:
        async with httpx.AsyncClient() as http:
            await client.start_rollouts(http, plain.urls["simple_agent"], ROLLOUTS)
            expected = client.final_results(await client.wait_finished(http, plain.urls["simple_agent"]))
    with make_cluster(None) as first:
        config = configure(first, ledger_url)
        async with httpx.AsyncClient() as http:
            for name in ("policy_model", "tools"):
                await http.post(f"{first.urls[name]}/gymsim/admin/options", json={"latency_s": 0.05})
            await client.start_rollouts(http, first.urls["simple_agent"], ROLLOUTS)
            await client.wait_turns(http, first.urls["simple_agent"], 2)
            snapshot = await _first_snapshot(config)
    return snapshot, expected


async def _die_during_restore(config: ClusterConfig, snapshot: Path) -> str:
    with pytest.raises(Died):
        async with Coordinator.open(config) as coord:
            await coord.restore(snapshot)
    async with Ledger.open(config.ledger, readonly=True) as ledger:
        rows = [row for row in await ledger.attempts() if row.outcome is None]
    assert len(rows) == 1
    return rows[0].checkpoint_id


async def test_interrupted_restore_is_redriven_then_left_paused(
    make_cluster: Any, sqlite_url: str, configure: Any, die_after: Any
) -> None:
    snapshot, expected = await _snapshot_mid_rollout(make_cluster, configure, sqlite_url)
    with make_cluster(None) as fresh:
        config = configure(fresh, sqlite_url)
        die_after(kind_is("call.replied", server="simple_agent"), nth=2)  # discovery, restore
        cid = await _die_during_restore(config, snapshot)
        async with httpx.AsyncClient() as http:
            assert (await server_states(http, fresh))["tools"] == ("idle", "accepting")
            async with Coordinator.open(config) as coord:
                report = coord.last_recovery
                assert report is not None
                states = await server_states(http, fresh)
                for name in ("policy_model", "simple_agent", "tools"):
                    assert states[name][0] == "restored_paused"
                outcome = await coord.resume()
            assert (outcome.checkpoint_id, outcome.outcome) == (cid, "resumed")
            await assert_all_accepting(http, fresh)
            logs = await control_logs(http, fresh)
            # the recovered restore says what to send again, and so does its resume's outcome
            sent_again = tuple(Resubmission("simple_agent", rid, 1) for rid in sorted(ROLLOUTS))
            assert report.attempts[0].resubmit == outcome.resubmit == sent_again
            assert report.as_json()["attempts"][0]["resubmit"][0] == sent_again[0].as_json()
            await client.resubmit(http, fresh.urls["simple_agent"], outcome.resubmit)
            rollouts = await client.wait_finished(http, fresh.urls["simple_agent"], timeout_s=60)
    found = report.attempts[0]
    assert (found.kind, found.found, found.action) == ("restore", "restore", "restored")
    assert sorted((s.name, s.result) for s in found.servers) == [
        ("policy_model", "restored"),
        ("simple_agent", "restored"),
        ("tools", "restored"),
    ]
    assert "quiesce resume" in found.message
    restores = [e for e in logs["policy_model"] if e["path"].endswith("/restore")]
    assert {e["checkpoint_id"] for e in restores} == {cid}  # the same restore id, replayed
    assert client.final_results(rollouts) == expected
    assert client.turn_log_problems(rollouts) == []
    completed = [
        ev.data["outcome"] for ev in await read_events(sqlite_url, cid) if ev.kind == "attempt.completed"
    ]
    assert completed == ["restored", "resumed"]
    await assert_protocol_ok(sqlite_url)


async def test_restore_with_its_snapshot_gone_is_abandoned_and_stays_paused(
    make_cluster: Any, sqlite_url: str, configure: Any, die_after: Any
) -> None:
    snapshot, _ = await _snapshot_mid_rollout(make_cluster, configure, sqlite_url)
    with make_cluster(None) as fresh:
        config = configure(fresh, sqlite_url)
        # the policy's restore reply (staged) commits with the agent restore's call.sent: the agent
        # is recorded as touched, but its request never left
        die_after(kind_is("call.replied", server="policy_model", status=200), nth=2)  # discovery, restore
        cid = await _die_during_restore(config, snapshot)
        shutil.rmtree(snapshot)
        async with httpx.AsyncClient() as http:
            async with Coordinator.open(config) as coord:
                report = coord.last_recovery
            states = await server_states(http, fresh)
    assert report is not None
    assert not report.ok
    found = report.attempts[0]
    assert found.action == "abandoned"
    assert [(s.name, s.reported_phase, s.result) for s in found.servers] == [
        ("policy_model", "restored_paused", "left_paused"),
        ("simple_agent", "idle", "not_paused"),
    ]
    assert "restore another snapshot" in found.message
    assert "stay paused (half-restored state must not run): policy_model." in found.message
    assert states["policy_model"][0] == "restored_paused"  # half-restored state must not run
    assert states["simple_agent"] == ("idle", "accepting")  # never touched
    async with Ledger.open(sqlite_url, readonly=True) as ledger:
        row = await ledger.attempt(cid)
    assert row is not None
    assert (row.state, row.outcome) == ("abandoned", "abandoned")
    await assert_protocol_ok(sqlite_url)


async def test_restore_whose_snapshot_was_consistently_redigested_is_not_redriven(
    make_cluster: Any, sqlite_url: str, configure: Any, die_after: Any
) -> None:
    """Between the death and the recovery, one file of the snapshot is replaced and the top
    manifest re-digested to match (its own check passes): the re-driven restore is refused by the
    manifest digest the restore recorded when it began, and the servers stay paused."""
    snapshot, _ = await _snapshot_mid_rollout(make_cluster, configure, sqlite_url)
    with make_cluster(None) as fresh:
        config = configure(fresh, sqlite_url)
        die_after(kind_is("call.replied", server="policy_model", status=200), nth=2)  # discovery, restore
        cid = await _die_during_restore(config, snapshot)
        began = load_snapshot(snapshot)
        started = next(e for e in await read_events(sqlite_url, cid) if e.kind == "attempt.started")
        assert (
            started.data["manifest_sha256"]
            == hashlib.sha256((snapshot / "manifest.json").read_bytes()).hexdigest()
        )
        manifest = json.loads((snapshot / "manifest.json").read_text())
        forged = next(
            f
            for f in manifest["files"]
            if f["path"].startswith("resources/") and not f["path"].endswith("manifest.json")
        )
        content = (snapshot / forged["path"]).read_bytes() + b"\n"
        (snapshot / forged["path"]).write_bytes(content)
        forged["bytes"], forged["sha256"] = len(content), hashlib.sha256(content).hexdigest()
        (snapshot / "manifest.json").write_text(json.dumps(manifest, indent=1))
        expected = {str(p["name"]): str(p["component"]) for p in began.participants}
        verify_snapshot(snapshot, participants=expected)  # a consistent forgery: its own check passes
        async with httpx.AsyncClient() as http:
            async with Coordinator.open(config) as coord:
                report = coord.last_recovery
            states = await server_states(http, fresh)
    assert report is not None
    found = report.attempts[0]
    assert found.action == "abandoned"
    assert "changed since the restore began" in found.message
    assert started.data["manifest_sha256"] in found.message
    assert states["policy_model"][0] == "restored_paused"  # half-restored state must not run
    await assert_protocol_ok(sqlite_url)


async def test_a_commit_the_killed_coordinator_left_running_is_waited_for_then_resumed(
    cluster: Any, sqlite_url: str, tmp_path: Path
) -> None:
    """A real `quiesce checkpoint` process is SIGKILLed while the agent still commits (a commit
    slower than `control_timeout_s`). Recovery waits for the commit to end — to the attempt's
    deadline, not only its own short budget — and then resumes the agent: a resume sent while it
    commits is refused, and counting that refusal as "never paused" would leave the agent paused
    for good once the commit ends."""
    path = cluster.write_config(
        tmp_path / "cluster.yaml", sqlite_url, tmp_path / "snapshots", control_timeout_s=1.0
    )
    config = load_config(path)
    agent = cluster.urls["simple_agent"]
    await _first_snapshot(config)
    async with httpx.AsyncClient() as http:
        await _start(http, cluster)
        slow = {"kind": "delay", "when": "during", "path": "/agent-checkpoint/commit", "seconds": 4.0}
        await set_faults(http, agent, [{**slow, "times": 1}])
        command = [sys.executable, "-m", "quiesce", "checkpoint", "--config", str(path), "--deadline-s", "30"]
        child = await anyio.open_process(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            with anyio.fail_after(30):
                while await _phase(http, agent) != "committing":  # noqa: ASYNC110 (another process)
                    await anyio.sleep(0.05)
        finally:
            child.kill()  # SIGKILL: no rollback, no cleanup
            await child.wait()
        cid = await _unfinished_checkpoint_id(config)
        report = await _recover(config)
        await assert_all_accepting(http, cluster)
        await _finish_rollouts(http, cluster)
    found = report.attempts[0]
    assert (found.checkpoint_id, found.action) == (cid, "resumed")
    servers = {s.name: (s.reported_phase, s.result) for s in found.servers}
    assert servers["simple_agent"] == ("committed_paused", "resumed")
    events = await read_events(sqlite_url, cid)
    assert events[-1].kind == "attempt.aborted"
    assert (events[-1].data["left_paused"], "simple_agent" in events[-1].data["resumed"]) == ([], True)
    await assert_protocol_ok(sqlite_url)


async def _phase(http: httpx.AsyncClient, url: str) -> str:
    return str((await http.get(f"{url}/ng-control/v1/capabilities")).json()["phase"])


async def test_each_resume_group_has_its_own_budget(
    cluster: Any, sqlite_url: str, configure: Any, die_after: Any
) -> None:
    """Recovery's resumes get `control_timeout_s` per role group: a slow policy model resume (a
    multi-worker model waits for its workers) does not use up the agents' time after it."""
    config = configure(cluster, sqlite_url, control_timeout_s=1.0)
    await _first_snapshot(config)
    die_after(kind_is("phase.completed", phase="prepare"))
    async with httpx.AsyncClient() as http:
        await _start(http, cluster)
        cid = await _die_during_checkpoint(config)
        slow = {"kind": "delay", "when": "before", "times": 1}
        await set_faults(
            http, cluster.urls["policy_model"], [{**slow, "path": "/model-admission/resume", "seconds": 0.9}]
        )
        await set_faults(
            http, cluster.urls["simple_agent"], [{**slow, "path": "/agent-checkpoint/resume", "seconds": 0.3}]
        )
        report = await _recover(config)
        await assert_all_accepting(http, cluster)
        await _finish_rollouts(http, cluster)
    found = report.attempts[0]
    assert found.checkpoint_id == cid
    assert [(s.name, s.result) for s in found.servers] == [
        ("tools", "resumed"),
        ("policy_model", "resumed"),
        ("simple_agent", "resumed"),
    ]
