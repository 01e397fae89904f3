"""What a v1 restore leaves to the trainer: resubmissions it cannot read are unknown (not a
refusal), saved turns on a restart_only server are discarded and listed as restarts, and a failure
shows the provenance warning.

Issue 36, items 2, 5 and 12, against real gymsim servers, real SQLite, the real CLI and a real
`quiesce serve`.

- An agent folder the resubmission list cannot be read from (a record whose identity is not its
  file name, the continuation index listed among the files, another layout) no longer refuses the
  restore: the servers are restored, and that agent's resubmissions are reported unknown with the
  reason — embedded API, CLI text and `--json`, the service. A record whose digest is not its
  agent manifest's still refuses it, before any server is contacted.
- A later agent (`discard_restored_continuation_v1`, `agent_resource_dependency_index_v1`) gets
  each restored continuation that depends on a `restart_only` resources server discarded — one
  recorded call each, while it is `restored_paused` — and those executions are listed as
  restarts, not resubmissions; started afresh they end as an uninterrupted run does.
- A restore of a snapshot copied under a new ledger that then fails at a server shows the
  provenance warning with the failure (CLI text, `--json`, the service).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator import (
    ClusterConfig,
    Coordinator,
    PhaseError,
    Resubmission,
    Snapshot,
    SnapshotError,
    parse_config,
)
from quiesce.coordinator.discovery import Member
from quiesce.coordinator.protocol import (
    AGENT,
    AGENT_CONTINUATIONS,
    AGENT_RESOURCE_DEPENDENCY_INDEX,
    CAPABILITIES_PATH,
    DISCARD_RESTORED_CONTINUATION,
    agent_instance_dir,
    route,
    sha256_hex,
)
from quiesce.coordinator.restore import can_discard, discard_plan, read_resubmissions
from quiesce.tools.gymsim import client
from quiesce.tools.gymsim.cluster import RunningCluster
from quiesce.tools.serve.client import RemoteCoordinator
from tests.coordinator.helpers import (
    assert_all_accepting,
    assert_protocol_ok,
    control_logs,
    read_events,
    server_states,
    set_faults,
)
from tests.hostile.helpers import no_traceback, run_cli
from tests.serve.conftest import ServiceProcess, spawn_service, wait_ready

__all__ = ["spawn_service"]

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

ROLLOUTS = {f"r{i}": 8 for i in range(3)}
AGENT_NAME = "simple_agent"
DISCARD_PATH = route(AGENT, "discard").full_path

#: policy model, judge, an agent of later Gym (discard) on a `restart_only` resources server
RESTART_ONLY = {
    "servers": [
        {"kind": "model", "name": "policy_model"},
        {"kind": "model", "name": "judge", "instance_role": "auxiliary"},
        {
            "kind": "agent",
            "name": AGENT_NAME,
            "policy": "policy_model",
            "resources": "tools",
            "discard": True,
        },
        {"kind": "resources", "name": "tools", "judge": "judge", "checkpoint_mode": "restart_only"},
    ]
}


def _config(running: RunningCluster, tmp_path: Path, db: str, snapshots: str = "snapshots") -> ClusterConfig:
    document = running.config(f"sqlite+aiosqlite:///{tmp_path / db}", tmp_path / snapshots)
    return parse_config(document, base_dir=tmp_path)


async def _checkpoint_mid_rollout(running: RunningCluster, config: ClusterConfig) -> Path:
    agent = running.urls[AGENT_NAME]
    async with httpx.AsyncClient(timeout=30) as http:
        for name in ("policy_model", "tools"):
            await http.post(f"{running.urls[name]}/gymsim/admin/options", json={"latency_s": 0.1})
        async with Coordinator.open(config) as coord:
            await coord.discover()
            await client.start_rollouts(http, agent, ROLLOUTS)
            await client.wait_turns(http, agent, 2)
            attempt = await coord.checkpoint(deadline_s=60)
        rollouts = await client.get_rollouts(http, agent)
    assert any(r["status"] != "completed" for r in rollouts.values()), "the checkpoint was not mid-rollout"
    assert attempt.snapshot is not None
    return attempt.snapshot


def _copied(snapshot: Path, tmp_path: Path) -> Path:
    """The snapshot copied, under its own id, into another snapshots folder (another ledger's)."""
    other = tmp_path / "copied"
    other.mkdir(exist_ok=True)
    return Path(shutil.copytree(snapshot, other / snapshot.name))


def _reseal(snapshot: Path, *, agent_manifest: bool = True) -> None:
    """Make the snapshot's own manifest agree with the agent's files again (and, with
    `agent_manifest`, its digest of the agent's manifest): a rewrite only the records can show."""
    folder = snapshot / agent_instance_dir(AGENT_NAME)
    manifest_file = snapshot / "manifest.json"
    manifest = json.loads(manifest_file.read_bytes())
    for entry in manifest["files"]:
        if entry["path"].startswith(agent_instance_dir(AGENT_NAME)):
            data = (snapshot / entry["path"]).read_bytes()
            entry.update(bytes=len(data), sha256=sha256_hex(data))
    if agent_manifest:
        agent = next(p for p in manifest["participants"] if p["name"] == AGENT_NAME)
        agent["manifest_digest"] = sha256_hex((folder / "manifest.json").read_bytes())
    manifest_file.write_text(json.dumps(manifest, sort_keys=True, indent=1))


def _rename_a_record(snapshot: Path) -> str:
    """Give one record a file name that is not its identity (its content and the continuation
    index unchanged, every digest agreeing): the agent restores it all the same, but the name no
    longer says which execution it is. Returns the record's new path in the snapshot."""
    folder = snapshot / agent_instance_dir(AGENT_NAME)
    agent_manifest = json.loads((folder / "manifest.json").read_bytes())
    name = sorted(agent_manifest["files"])[0]
    renamed = f"saved-{name}"
    (folder / name).rename(folder / renamed)
    agent_manifest["files"][renamed] = agent_manifest["files"].pop(name)
    (folder / "manifest.json").write_text(json.dumps(agent_manifest, sort_keys=True))
    manifest_file = snapshot / "manifest.json"
    manifest = json.loads(manifest_file.read_bytes())
    for entry in manifest["files"]:
        if entry["path"] == f"{agent_instance_dir(AGENT_NAME)}/{name}":
            entry["path"] = f"{agent_instance_dir(AGENT_NAME)}/{renamed}"
    manifest["files"].sort(key=lambda e: e["path"])
    manifest_file.write_text(json.dumps(manifest, sort_keys=True, indent=1))
    _reseal(snapshot)
    return f"{agent_instance_dir(AGENT_NAME)}/{renamed}"


# -- item 2: resubmissions that cannot be read ---------------------------------------------------


def test_the_continuation_index_among_the_files_is_not_a_record_and_another_layout_is_unknown(
    tmp_path: Path,
) -> None:
    """`read_resubmissions` on folders as agents write them (files on disk, no server)."""
    snapshot_dir = tmp_path / "ck-1"
    folder = snapshot_dir / agent_instance_dir(AGENT_NAME)
    folder.mkdir(parents=True)
    record = json.dumps({"rollout_id": "r0", "attempt_index": 2, "turns_done": 3}).encode()
    (folder / "r0.a2.json").write_bytes(record)
    row = json.dumps({"rollout_id": "r0", "attempt_index": 2, "capture_key": "r0-a2"}).encode() + b"\n"
    (folder / AGENT_CONTINUATIONS).write_bytes(row)
    index = {
        "relative_path": f"{agent_instance_dir(AGENT_NAME)}/{AGENT_CONTINUATIONS}",
        "sha256": sha256_hex(row),
        "records": 1,
        "bytes": len(row),
    }
    files = {"r0.a2.json": sha256_hex(record), AGENT_CONTINUATIONS: sha256_hex(row)}
    manifest = {"checkpoint_id": "ck-1", "files": files, "continuation_index": index}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    agent = Member(AGENT_NAME, AGENT, "export_restore", None, "agent", "http://127.0.0.1:9")
    found = read_resubmissions(Snapshot(snapshot_dir, {}), [agent])
    assert found.known == (Resubmission(AGENT_NAME, "r0", 3),)
    assert found.unknown == ()

    # another layout: a manifest of archives, no `files` (later Gym's sharded agent state)
    archived = {"schema_version": 2, "checkpoint_id": "ck-1", "archives": [], "continuation_index": index}
    (folder / "manifest.json").write_text(json.dumps(archived))
    found = read_resubmissions(Snapshot(snapshot_dir, {}), [agent])
    assert found.known == ()
    assert [u.server for u in found.unknown] == [AGENT_NAME]
    assert "is not a Gym agent manifest with record files" in found.unknown[0].reason
    assert "files" in found.unknown[0].reason

    # a record whose bytes are not the ones its agent's manifest names: still a refusal
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "r0.a2.json").write_bytes(record + b" ")
    with pytest.raises(SnapshotError) as caught:
        read_resubmissions(Snapshot(snapshot_dir, {}), [agent])
    assert caught.value.differences == [
        f"{AGENT_NAME}: {agent_instance_dir(AGENT_NAME)}/r0.a2.json: sha256 differs from the agent's manifest"
    ]


async def test_a_record_that_disagrees_with_its_name_is_restored_with_its_resubmissions_unknown(
    make_cluster: Any, tmp_path: Path, token: str, spawn_service: Any
) -> None:
    with make_cluster(None) as first:
        snapshot = await _checkpoint_mid_rollout(first, _config(first, tmp_path, "a.db"))
    copied = _copied(snapshot, tmp_path)
    where = _rename_a_record(copied)
    # embedded: restored, every server held, the agent's resubmissions unknown with the reason
    with make_cluster(None) as second:
        async with httpx.AsyncClient(timeout=30) as http:
            config = _config(second, tmp_path, "b.db", "copied")
            async with Coordinator.open(config) as coord:
                attempt = await coord.restore(copied)
                assert attempt.state == "restored"
                assert attempt.resubmit == ()
                assert attempt.restart == ()
                assert [u.server for u in attempt.resubmit_unknown] == [AGENT_NAME]
                reason = attempt.resubmit_unknown[0].reason
                assert where in reason
                assert "its identity disagrees with its name" in reason
                states = await server_states(http, second)
                assert states[AGENT_NAME][0] == "restored_paused"
                assert states["tools"][0] == "restored_paused"
                outcome = await coord.resume()
                assert outcome.resubmit_unknown == attempt.resubmit_unknown
                assert outcome.as_json()["resubmit_unknown"] == [
                    u.as_json() for u in attempt.resubmit_unknown
                ]
            await assert_all_accepting(http, second)
    await assert_protocol_ok(config.ledger)

    # the CLI, --json then text
    with make_cluster(None) as third:
        written = third.write_config(
            tmp_path / "c.yaml", f"sqlite+aiosqlite:///{tmp_path / 'c.db'}", tmp_path / "copied"
        )
        done = run_cli("restore", "--config", str(written), "--snapshot", str(copied), "--json", token=token)
        assert done.returncode == 0, done.stderr
        document = json.loads(done.stdout)
        assert document["outcome"] == "restored"
        assert document["resubmit"] == []
        assert document["restart"] == []
        assert [u["server"] for u in document["resubmit_unknown"]] == [AGENT_NAME]
        assert where in document["resubmit_unknown"][0]["reason"]
        assert "was not published by this ledger" in done.stderr  # the provenance warning, as before
        no_traceback(done)
    with make_cluster(None) as fourth:
        written = fourth.write_config(
            tmp_path / "d.yaml", f"sqlite+aiosqlite:///{tmp_path / 'd.db'}", tmp_path / "copied"
        )
        done = run_cli(
            "restore", "--config", str(written), "--snapshot", str(copied), "--resume", token=token
        )
        assert done.returncode == 0, done.stderr
        text = " ".join(done.stdout.split())
        assert f"resubmissions unknown on {AGENT_NAME}:" in text
        assert "its identity disagrees with its name" in text
        assert "send again:" not in text
        no_traceback(done)

        # the service: the restore outcome carries them, through RemoteCoordinator
        await _restart_all(fourth)
        served = fourth.write_config(
            tmp_path / "e.yaml", f"sqlite+aiosqlite:///{tmp_path / 'e.db'}", tmp_path / "copied"
        )
        service: ServiceProcess = spawn_service(served)
        await wait_ready(service.url)
        async with RemoteCoordinator(service.url) as remote:
            restored = await remote.restore(str(copied))
            assert restored.resubmit == ()
            assert [u.server for u in restored.resubmit_unknown] == [AGENT_NAME]
            assert where in restored.resubmit_unknown[0].reason
            assert restored.warnings
            assert "was not published by this ledger" in restored.warnings[0]
            resumed = await remote.resume()
            assert resumed.resubmit_unknown == restored.resubmit_unknown


async def _restart_all(running: RunningCluster) -> list[str]:
    """Restart every server of `running` (fresh processes: a restore needs servers that never ran)."""
    async with httpx.AsyncClient(timeout=30) as http:
        names = list(running.urls)
        for name in names:
            reply = await http.post(f"{running.urls[name]}/gymsim/admin/restart")
            assert reply.status_code == 200, reply.text
    return names


async def test_a_record_whose_digest_is_not_its_agent_manifests_still_refuses_the_restore(
    make_cluster: Any, tmp_path: Path
) -> None:
    with make_cluster(None) as first:
        snapshot = await _checkpoint_mid_rollout(first, _config(first, tmp_path, "a.db"))
    copied = _copied(snapshot, tmp_path)
    folder = copied / agent_instance_dir(AGENT_NAME)
    name = sorted(json.loads((folder / "manifest.json").read_bytes())["files"])[0]
    (folder / name).write_bytes((folder / name).read_bytes() + b"\n")
    _reseal(copied, agent_manifest=False)  # the snapshot's list agrees; the agent's manifest does not
    with make_cluster(None) as second:
        async with httpx.AsyncClient(timeout=30) as http:
            config = _config(second, tmp_path, "b.db", "copied")
            async with Coordinator.open(config) as coord:
                await coord.discover()
                with pytest.raises(SnapshotError) as caught:
                    await coord.restore(copied)
            record = f"{agent_instance_dir(AGENT_NAME)}/{name}"
            assert caught.value.differences == [
                f"{AGENT_NAME}: {record}: sha256 differs from the agent's manifest"
            ]
            assert "Nothing was restored and no server was contacted" in str(caught.value)
            logs = await control_logs(http, second)
            assert all(entry["path"] == CAPABILITIES_PATH for log in logs.values() for entry in log)
            await assert_all_accepting(http, second)


# -- item 5: restored continuations that depend on a restart_only resources server ---------------


async def _uninterrupted(make_cluster: Any) -> dict[str, Any]:
    with make_cluster(RESTART_ONLY) as running:
        async with httpx.AsyncClient(timeout=30) as http:
            await client.start_rollouts(http, running.urls[AGENT_NAME], ROLLOUTS)
            rollouts = await client.wait_finished(http, running.urls[AGENT_NAME], timeout_s=120)
    return client.final_results(rollouts)


async def test_continuations_on_a_restart_only_server_are_discarded_and_listed_as_restarts(
    make_cluster: Any, tmp_path: Path, token: str
) -> None:
    expected = await _uninterrupted(make_cluster)
    with make_cluster(RESTART_ONLY) as first:
        snapshot = await _checkpoint_mid_rollout(first, _config(first, tmp_path, "a.db"))
    index = (snapshot / agent_instance_dir(AGENT_NAME) / AGENT_CONTINUATIONS).read_text().splitlines()
    rows = [json.loads(line) for line in index]
    assert rows
    assert all(set(r["resource_state_revisions"]) == {"tools"} for r in rows)
    restarts = tuple(
        Resubmission(AGENT_NAME, r["rollout_id"], r["attempt_index"] + 1)
        for r in sorted(rows, key=lambda r: r["rollout_id"])
    )
    with make_cluster(RESTART_ONLY) as second:
        async with httpx.AsyncClient(timeout=30) as http:
            config = _config(second, tmp_path, "a.db")
            agent = second.urls[AGENT_NAME]
            async with Coordinator.open(config) as coord:
                attempt = await coord.restore(snapshot)
                assert attempt.restart == restarts
                assert not set(attempt.resubmit) & set(restarts)
                assert attempt.resubmit_unknown == ()
                assert (await server_states(http, second))[AGENT_NAME][0] == "restored_paused"
                views = await client.get_rollouts(http, agent)
                assert not {r.rollout_id for r in restarts} & set(views)  # gone from the agent
                outcome = await coord.resume()
                assert outcome.restart == restarts
                assert outcome.as_json()["restart"] == [r.as_json() for r in restarts]
            # the trainer starts each restart afresh: its /run runs from the task, and ends as uninterrupted
            for r in restarts:
                await client.start_rollout(
                    http, agent, r.rollout_id, ROLLOUTS[r.rollout_id], attempt_index=r.attempt_index
                )
            await client.resubmit(http, agent, attempt.resubmit)
            rollouts = await client.wait_finished(http, agent, timeout_s=120)
            for r in restarts:
                assert rollouts[r.rollout_id]["attempt_index"] == r.attempt_index
                assert rollouts[r.rollout_id]["restored_from"] == []  # not from the saved turn
            assert {rid: rollouts[rid]["result"] for rid in sorted(rollouts)} == {
                rid: expected[rid] for rid in sorted(rollouts)
            }
    # each discard is a recorded control call of the restore phase, sent and answered
    events = await read_events(config.ledger, attempt.checkpoint_id)
    sent = [e for e in events if e.kind == "call.sent" and e.data.get("path") == DISCARD_PATH]
    assert [(e.data["body"]["rollout_id"], e.data["body"]["attempt_index"]) for e in sent] == [
        (r.rollout_id, r.attempt_index) for r in restarts
    ]
    assert all(e.data["phase"] == "restore" and e.server == AGENT_NAME for e in sent)
    assert all(e.data["body"]["checkpoint_id"] == attempt.checkpoint_id for e in sent)
    replied = {e.call_id: e for e in events if e.kind == "call.replied"}
    assert all(replied[e.call_id].data.get("status") == 200 for e in sent)
    await assert_protocol_ok(config.ledger)

    # the CLI lists them as restarts, in --json and in text
    with make_cluster(RESTART_ONLY) as third:
        written = third.write_config(
            tmp_path / "c.yaml", f"sqlite+aiosqlite:///{tmp_path / 'a.db'}", tmp_path / "snapshots"
        )
        done = run_cli(
            "restore",
            "--config",
            str(written),
            "--snapshot",
            str(snapshot),
            "--json",
            "--resume",
            token=token,
        )
        assert done.returncode == 0, done.stderr
        document = json.loads(done.stdout)
        assert document["restart"] == [r.as_json() for r in restarts]
        assert not {json.dumps(r, sort_keys=True) for r in document["resubmit"]} & {
            json.dumps(r.as_json(), sort_keys=True) for r in restarts
        }
        no_traceback(done)
        await _restart_all(third)
        done = run_cli("restore", "--config", str(written), "--snapshot", str(snapshot), token=token)
        assert done.returncode == 0, done.stderr
        text = " ".join(done.stdout.split())
        for r in restarts:
            assert (
                f"start afresh: rollout {r.rollout_id} as attempt {r.attempt_index} on {AGENT_NAME}" in text
            )
        no_traceback(done)
        # the agent restarts before the resume, which another process runs: it restores the agent
        # again and discards again, by the plan the restore recorded, and lists the same restarts
        async with httpx.AsyncClient(timeout=30) as http:
            reply = await http.post(f"{third.urls[AGENT_NAME]}/gymsim/admin/restart")
            assert reply.status_code == 200, reply.text
            done = run_cli("resume", "--config", str(written), "--json", token=token)
            assert done.returncode == 0, done.stderr
            document = json.loads(done.stdout)
            assert document["outcome"] == "resumed"
            assert document["restored_again"] == [AGENT_NAME]
            assert document["restart"] == [r.as_json() for r in restarts]
            no_traceback(done)
            views = await client.get_rollouts(http, third.urls[AGENT_NAME])
            assert not {r.rollout_id for r in restarts} & set(views)  # discarded again, not continued
        cid = document["checkpoint_id"]
        sent = [
            e
            for e in await read_events(config.ledger, cid)
            if e.kind == "call.sent" and e.data.get("path") == DISCARD_PATH
        ]
        assert len(sent) == 2 * len(restarts)  # once by the restore, once by the re-drive


async def test_a_discard_that_fails_fails_the_restore_and_nothing_runs(
    make_cluster: Any, tmp_path: Path
) -> None:
    with make_cluster(RESTART_ONLY) as first:
        snapshot = await _checkpoint_mid_rollout(first, _config(first, tmp_path, "a.db"))
    with make_cluster(RESTART_ONLY) as second:
        async with httpx.AsyncClient(timeout=30) as http:
            fault = [{"kind": "fail", "path": route(AGENT, "discard").path, "status": 500, "times": 1}]
            await set_faults(http, second.urls[AGENT_NAME], fault)
            config = _config(second, tmp_path, "a.db")
            async with Coordinator.open(config) as coord:
                with pytest.raises(PhaseError) as caught:
                    await coord.restore(snapshot)
            assert caught.value.phase == "restore"
            assert caught.value.server == AGENT_NAME
            assert "discard of a restored continuation failed" in str(caught.value)
            assert caught.value.resumed == []
            assert AGENT_NAME in caught.value.not_resumed
            states = await server_states(http, second)
            assert states[AGENT_NAME][0] == "restored_paused"  # its saved turns must not run as they are
        aborted = [e for e in await read_events(config.ledger) if e.kind == "attempt.aborted"]
        assert len(aborted) == 1
        assert AGENT_NAME in aborted[0].data["left_paused"]
        await assert_protocol_ok(config.ledger)


def test_which_continuations_are_discarded_is_read_from_the_committed_index(tmp_path: Path) -> None:
    """`discards` / `discard_plan` on an index as Gym writes it (files on disk, no server): a row
    naming a restart_only server, or saying nothing (null), goes; a row on other servers stays; an
    agent without both features is never asked; an index that is not the committed one refuses."""
    folder = tmp_path / "ck-2" / agent_instance_dir(AGENT_NAME)
    folder.mkdir(parents=True)
    rows = [
        {"rollout_id": "a", "attempt_index": 0, "capture_key": "a", "resource_state_revisions": {"tools": 3}},
        {
            "rollout_id": "b",
            "attempt_index": 1,
            "capture_key": "b-a1",
            "resource_state_revisions": {"kept": 1},
        },
        {"rollout_id": "c", "attempt_index": 0, "capture_key": "c", "resource_state_revisions": None},
        {"rollout_id": "d", "attempt_index": 0, "capture_key": "d", "resource_state_revisions": {}},
    ]
    for row in rows:
        row["last_committed_model_call_id"] = f"call-{row['rollout_id']}"
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    (folder / AGENT_CONTINUATIONS).write_bytes(data)
    ref = {
        "relative_path": f"{agent_instance_dir(AGENT_NAME)}/{AGENT_CONTINUATIONS}",
        "sha256": sha256_hex(data),
        "records": len(rows),
        "bytes": len(data),
    }
    snapshot = Snapshot(
        tmp_path / "ck-2", {"participants": [{"name": AGENT_NAME, "continuation_index": ref}]}
    )
    later = Member(
        AGENT_NAME,
        AGENT,
        "export_restore",
        None,
        "agent",
        "http://127.0.0.1:9",
        features=(DISCARD_RESTORED_CONTINUATION, AGENT_RESOURCE_DEPENDENCY_INDEX),
    )
    anchor = Member(AGENT_NAME, AGENT, "export_restore", None, "agent", "http://127.0.0.1:9")
    assert can_discard(later)
    assert not can_discard(anchor)  # it cannot discard: never asked
    plan = discard_plan(snapshot, [AGENT_NAME], ["tools"])
    assert plan.known == (Resubmission(AGENT_NAME, "a", 1), Resubmission(AGENT_NAME, "c", 1))
    assert discard_plan(snapshot, [AGENT_NAME], []).known == ()  # no restart_only server: nothing goes
    assert discard_plan(snapshot, [], ["tools"]).known == ()

    (folder / AGENT_CONTINUATIONS).write_bytes(data + b"\n")
    with pytest.raises(SnapshotError) as caught:
        discard_plan(snapshot, [AGENT_NAME], ["tools"])
    assert "which saved continuations depend on them cannot be read" in str(caught.value)
    assert caught.value.differences == [
        f"{AGENT_NAME}: its continuation index is unusable: {ref['relative_path']}: sha256 differs from"
        " the committed one"
    ]
    assert "Nothing was restored and no server was contacted" in str(caught.value)


async def test_an_agent_without_the_discard_features_keeps_its_continuations(
    make_cluster: Any, tmp_path: Path
) -> None:
    spec = json.loads(json.dumps(RESTART_ONLY))
    spec["servers"][2]["discard"] = False
    with make_cluster(spec) as first:
        snapshot = await _checkpoint_mid_rollout(first, _config(first, tmp_path, "a.db"))
    with make_cluster(spec) as second:
        async with httpx.AsyncClient(timeout=30) as http:
            config = _config(second, tmp_path, "a.db")
            async with Coordinator.open(config) as coord:
                attempt = await coord.restore(snapshot, resume=True)
            assert attempt.restart == ()
            index = (snapshot / agent_instance_dir(AGENT_NAME) / AGENT_CONTINUATIONS).read_text().splitlines()
            depending = {json.loads(line)["rollout_id"] for line in index}
            assert depending
            assert depending <= {
                r.rollout_id for r in attempt.resubmit
            }  # continued, as the agent cannot drop them
            logs = await control_logs(http, second)
            assert not any(entry["path"] == DISCARD_PATH for log in logs.values() for entry in log)


# -- item 12: the provenance warning with a failure ---------------------------------------------


async def test_a_failed_restore_of_a_copied_snapshot_shows_the_provenance_warning(
    make_cluster: Any, tmp_path: Path, token: str, spawn_service: Any
) -> None:
    with make_cluster(None) as first:
        snapshot = await _checkpoint_mid_rollout(first, _config(first, tmp_path, "a.db"))
    copied = _copied(snapshot, tmp_path)
    fault = [{"kind": "fail", "path": route(AGENT, "restore").path, "status": 500, "code": "disk_on_fire"}]
    with make_cluster(None) as second:
        async with httpx.AsyncClient(timeout=30) as http:
            await set_faults(http, second.urls[AGENT_NAME], fault)
            config = _config(second, tmp_path, "b.db", "copied")
            async with Coordinator.open(config) as coord:
                with pytest.raises(PhaseError) as caught:
                    await coord.restore(copied)
            assert caught.value.server == AGENT_NAME
            assert len(caught.value.warnings) == 1
            assert "was not published by this ledger" in caught.value.warnings[0]

            written = second.write_config(
                tmp_path / "c.yaml", f"sqlite+aiosqlite:///{tmp_path / 'c.db'}", tmp_path / "copied"
            )
            await _restart_all(second)
            await set_faults(http, second.urls[AGENT_NAME], fault)
            done = run_cli("restore", "--config", str(written), "--snapshot", str(copied), token=token)
            assert done.returncode == 1
            err = " ".join(done.stderr.split())
            assert "warning: snapshot" in err
            assert "was not published by this ledger" in err
            assert f"failed at {AGENT_NAME}" in err
            assert err.index("was not published by this ledger") < err.index(f"failed at {AGENT_NAME}")
            no_traceback(done)

            await _restart_all(second)
            await set_faults(http, second.urls[AGENT_NAME], fault)
            done = run_cli(
                "restore", "--config", str(written), "--snapshot", str(copied), "--json", token=token
            )
            assert done.returncode == 1
            document = json.loads(done.stdout)
            assert document["outcome"] == "failed"
            assert document["error"]["server"] == AGENT_NAME
            assert len(document["error"]["warnings"]) == 1
            assert "was not published by this ledger" in document["error"]["warnings"][0]

            await _restart_all(second)
            await set_faults(http, second.urls[AGENT_NAME], fault)
            served = second.write_config(
                tmp_path / "e.yaml", f"sqlite+aiosqlite:///{tmp_path / 'e.db'}", tmp_path / "copied"
            )
            service: ServiceProcess = spawn_service(served)
            await wait_ready(service.url)
            raw = await http.post(f"{service.url}/v1/restore", json={"snapshot": str(copied)})
            assert raw.status_code == 502, raw.text
            body = raw.json()["error"]
            assert body["type"] == "PhaseError"
            assert body["server"] == AGENT_NAME
            assert "was not published by this ledger" in body["warnings"][0]
            await _restart_all(second)
            await set_faults(http, second.urls[AGENT_NAME], fault)
            async with RemoteCoordinator(service.url) as remote:
                with pytest.raises(PhaseError) as remote_caught:
                    await remote.restore(str(copied))
            assert remote_caught.value.warnings == body["warnings"]
            await _restart_all(second)
            await set_faults(http, second.urls[AGENT_NAME], fault)
            done = run_cli("restore", "--service", service.url, "--snapshot", str(copied), token=token)
            assert done.returncode == 1
            assert "was not published by this ledger" in " ".join(done.stderr.split())
            no_traceback(done)
