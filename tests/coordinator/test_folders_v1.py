"""Several v1 Gym deployments in one cluster, each in its own folder of every snapshot (`folder` in
the cluster config), against real v1 reference servers.

NeMo RL runs replicas of one Gym config: their v1 servers report the same names and write under
them (`model-ledger/<name>/`, `agent/instance-<sha256(name)>/`, `resources/<name>/`). Each
deployment's servers get their own folder and may report a name other than their config name; the
policy model of a folder is handed the continuation indexes of that folder's agents only (another
deployment's index is a `ledger_mismatch` to it, as to Gym's); a restore reads each server's state
from the folder its publication recorded. Two servers that would write the same files are refused
at discovery, naming both; a reported name differing from the config's without a folder still is.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator import ClusterConfig, Coordinator, PhaseError, Resubmission, parse_config
from quiesce.coordinator.errors import DiscoveryError, SnapshotError
from quiesce.coordinator.protocol import AGENT, MODEL, RESOURCES, agent_instance_dir, manifest_path
from quiesce.coordinator.readback import read_attempt
from quiesce.ledger import Event, Ledger
from quiesce.tools.audit.check import check_events
from quiesce.tools.gymsim import client
from quiesce.tools.gymsim.cluster import RunningCluster
from quiesce.tools.gymsim.spec import ClusterSpec, replica_spec
from tests.cli.helpers import json_of, quiesce
from tests.coordinator.helpers import assert_protocol_ok, read_events

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

MakeCluster = Callable[[Any], AbstractContextManager[RunningCluster]]

#: One Gym deployment: a policy model, an agent calling it and a resources server.
BASE: dict[str, Any] = {
    "servers": [
        {"kind": "model", "name": "policy_model", "latency_s": 0.01},
        {"kind": "agent", "name": "simple_agent", "policy": "policy_model", "resources": "tools"},
        {"kind": "resources", "name": "tools"},
    ]
}
GYM_NAMES = {"policy_model": MODEL, "simple_agent": AGENT, "tools": RESOURCES}
#: Each deployment's rollouts (distinct ids: one trainer runs them all), id -> turns.
ROLLOUTS = {"a": {"a0": 8, "a1": 8}, "b": {"b0": 8, "b1": 8, "b2": 8}}


def deployment(prefix: str) -> dict[str, Any]:
    """Deployment `prefix` as a replica of `BASE` (`replica_spec`): servers `<prefix>.<name>`, each
    still reporting — and writing under — its plain Gym name."""
    return replica_spec(ClusterSpec.model_validate(BASE), f"{prefix}.").model_dump(mode="json")


@contextmanager
def deployments(make_cluster: MakeCluster, *prefixes: str) -> Iterator[dict[str, RunningCluster]]:
    with ExitStack() as stack:
        yield {p: stack.enter_context(make_cluster(deployment(p))) for p in prefixes}


def union_config(
    tmp_path: Path, ledger_url: str, running: dict[str, RunningCluster], folders: dict[str, str | None]
) -> ClusterConfig:
    """One cluster config over every deployment's servers, deployment `p` in `folders[p]` (None: none)."""
    servers: list[dict[str, Any]] = []
    for prefix, cluster in running.items():
        for name, url in cluster.urls.items():
            folder = folders[prefix]
            servers.append({"name": name, "url": url, **({"folder": folder} if folder else {})})
    document = {"ledger": ledger_url, "snapshots": str(tmp_path / "snapshots"), "servers": servers}
    return parse_config(document, base_dir=tmp_path)


def each_in_its_folder(running: dict[str, RunningCluster]) -> dict[str, str | None]:
    return {p: p for p in running}


async def commit_calls(ledger_url: str, checkpoint_id: str, route: str) -> dict[str, tuple[Any, Any]]:
    """Server -> (request body, reply body) of each `route` call (`commit`, `restore`) of an attempt."""
    events = await read_events(ledger_url, checkpoint_id)
    sent = {ev.call_id: ev for ev in events if ev.kind == "call.sent" and ev.data["path"].endswith(route)}
    replies = {ev.call_id: ev.data.get("body") for ev in events if ev.kind == "call.replied"}
    return {str(ev.server): (ev.data["body"], replies.get(ev.call_id)) for ev in sent.values()}


async def uninterrupted(make_cluster: MakeCluster) -> dict[str, dict[str, Any]]:
    """Each deployment's rollout results when nothing interrupts them."""
    with deployments(make_cluster, "a", "b") as running:
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            results = {}
            for prefix, cluster in running.items():
                agent = cluster.urls[f"{prefix}.simple_agent"]
                await client.start_rollouts(http, agent, ROLLOUTS[prefix])
                results[prefix] = client.final_results(await client.wait_finished(http, agent, timeout_s=60))
    return results


async def save_mid_rollout(
    running: dict[str, RunningCluster], config: ClusterConfig, http: httpx.AsyncClient
) -> Any:
    """Rollouts on both deployments, two turns in, parked by a checkpoint; returns its attempt."""
    for cluster in running.values():
        for name, url in cluster.urls.items():
            if not name.endswith("simple_agent"):
                await http.post(f"{url}/gymsim/admin/options", json={"latency_s": 0.05})
    async with Coordinator.open(config) as coord:
        found = await coord.discover()
        assert found.refused == ()
        assert found.warnings == ()  # one policy model per folder: no "more than one policy" warning
        assert {m.name: (m.folder, m.gym_name) for m in found.participants} == {
            f"{p}.{n}": (p, n) for p in running for n in GYM_NAMES
        }
        for prefix, cluster in running.items():
            await client.start_rollouts(http, cluster.urls[f"{prefix}.simple_agent"], ROLLOUTS[prefix])
        for prefix, cluster in running.items():
            await client.wait_turns(http, cluster.urls[f"{prefix}.simple_agent"], 2)
        attempt = await coord.checkpoint(deadline_s=30)
    for prefix, cluster in running.items():
        views = await client.get_rollouts(http, cluster.urls[f"{prefix}.simple_agent"])
        assert all(v["status"] != "completed" for v in views.values()), "the save was not mid-rollout"
    return attempt


async def test_two_deployments_with_the_same_names_save_and_restore_each_in_its_folder(
    make_cluster: MakeCluster, tmp_path: Path, sqlite_url: str
) -> None:
    expected = await uninterrupted(make_cluster)
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        with deployments(make_cluster, "a", "b") as running:
            config = union_config(tmp_path, sqlite_url, running, each_in_its_folder(running))
            attempt = await save_mid_rollout(running, config, http)
    snapshot, staging = attempt.snapshot, attempt.staging_dir
    assert snapshot is not None
    assert staging is not None

    # each server committed into its deployment's folder, under the name it reports
    commits = await commit_calls(sqlite_url, attempt.checkpoint_id, "/commit")
    assert {n: body["checkpoint_dir"] for n, (body, _) in commits.items()} == {
        f"{p}.{n}": str(staging / p) for p in "ab" for n in GYM_NAMES
    }
    # each model was handed its own folder's agent's index only; the two indexes share a path
    # (the agents report one name) and differ in content
    own = {p: commits[f"{p}.simple_agent"][1]["continuation_index"] for p in "ab"}
    assert (
        own["a"]["relative_path"]
        == own["b"]["relative_path"]
        == (f"{agent_instance_dir('simple_agent')}/continuations.jsonl")
    )
    assert own["a"]["sha256"] != own["b"]["sha256"]
    for p in "ab":
        assert commits[f"{p}.policy_model"][0]["continuation_indexes"] == [own[p]]

    manifest = json.loads((snapshot / "manifest.json").read_text())
    entries = {e["name"]: e for e in manifest["participants"]}
    listed = {f["path"] for f in manifest["files"]}
    for p in "ab":
        for gym, component in GYM_NAMES.items():
            entry = entries[f"{p}.{gym}"]
            assert entry["folder"] == p
            assert entry["manifest"] == f"{p}/{manifest_path(component, gym)}"
            assert entry["manifest"] in listed
        # the references stay as the server gave them: relative to its folder
        assert entries[f"{p}.simple_agent"]["continuation_index"] == own[p]
        index = entries[f"{p}.policy_model"]["storage_reference_index"]
        assert index["relative_path"] == "model-ledger/policy_model/storage-references.jsonl"
        assert f"{p}/{index['relative_path']}" in listed
        # each model's ledger holds its own deployment's rollouts, as its agent's records do
        ledger = json.loads((snapshot / p / "model-ledger/policy_model/manifest.json").read_text())
        records = json.loads(
            (snapshot / p / agent_instance_dir("simple_agent") / "manifest.json").read_text()
        )
        saved = {json.loads((snapshot / p / agent_instance_dir("simple_agent") / f).read_text())["rollout_id"]
                 for f in records["files"]}  # fmt: skip
        assert set(ledger["rollouts"]) == saved == set(ROLLOUTS[p])
    assert not (snapshot / "model-ledger").exists()  # nothing at the top: every server in its folder
    captured = [
        e for e in await read_events(sqlite_url, attempt.checkpoint_id) if e.kind == "rollouts.captured"
    ]
    assert {n: sorted(r["rollout_id"] for r in rs) for n, rs in captured[0].data["captured"].items()} == {
        f"{p}.simple_agent": sorted(ROLLOUTS[p]) for p in "ab"
    }

    # the ledger's discovery names each server's folder and the name it writes under, and an
    # attempt read back from the ledger (recovery's view) has them too
    discovered = [e for e in await read_events(sqlite_url) if e.kind == "discovery.completed"][-1]
    assert {p["name"]: (p["folder"], p["reported_name"]) for p in discovered.data["participants"]} == {
        f"{p}.{gym}": (p, gym) for p in "ab" for gym in GYM_NAMES
    }
    async with Ledger.open(sqlite_url, readonly=True) as ledger:
        recorded = await read_attempt(ledger, config, attempt.checkpoint_id)
    assert recorded is not None
    assert {m.name: (m.folder, m.gym_name) for m in recorded.attempt.participants} == {
        f"{p}.{gym}": (p, gym) for p in "ab" for gym in GYM_NAMES
    }

    # restore into fresh servers of both deployments: each from its folder
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        with deployments(make_cluster, "a", "b") as fresh:
            config = union_config(tmp_path, sqlite_url, fresh, each_in_its_folder(fresh))
            async with Coordinator.open(config) as coord:
                restored = await coord.restore(snapshot, resume=True)
            assert restored.state == "completed"
            restores = await commit_calls(sqlite_url, restored.checkpoint_id, "/restore")
            assert {n: body["checkpoint_dir"] for n, (body, _) in restores.items()} == {
                f"{p}.{n}": str(snapshot / p) for p in "ab" for n in GYM_NAMES
            }
            for p in "ab":
                agent = f"{p}.simple_agent"
                assert restored.resubmit_on(agent) == tuple(
                    Resubmission(agent, rid, 1) for rid in sorted(ROLLOUTS[p])
                )
                url = fresh[p].urls[agent]
                await client.resubmit(http, url, restored.resubmit_on(agent))
                rollouts = await client.wait_finished(http, url, timeout_s=60)
                assert client.final_results(rollouts) == expected[p]
                assert client.turn_log_problems(rollouts) == []
            assert restored.resubmit_unknown == ()
    await assert_protocol_ok(sqlite_url)
    done = quiesce("check", "--ledger", sqlite_url, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json_of(done)["violations"] == []


async def test_servers_that_would_write_the_same_files_are_refused_naming_both(
    make_cluster: MakeCluster, tmp_path: Path, sqlite_url: str
) -> None:
    with deployments(make_cluster, "a", "b") as running:
        # one folder for both deployments: the same component, reported name and folder
        config = union_config(tmp_path, sqlite_url, running, {"a": "x", "b": "x"})
        async with Coordinator.open(config) as coord:
            with pytest.raises(DiscoveryError) as caught:
                await coord.discover()
        reasons = dict(caught.value.reasons)
        assert sorted(reasons) == ["b.policy_model", "b.simple_agent", "b.tools"]
        for gym in GYM_NAMES:
            assert f"reports its name as {gym!r}, as a.{gym} does" in reasons[f"b.{gym}"]
            assert "in folder 'x'" in reasons[f"b.{gym}"]
            assert "its own `folder`" in reasons[f"b.{gym}"]
        assert "model-ledger/policy_model/" in reasons["b.policy_model"]
        # without a folder, a reported name differing from the config's is refused as before
        config = union_config(tmp_path, sqlite_url, running, {"a": "a", "b": None})
        async with Coordinator.open(config) as coord:
            with pytest.raises(DiscoveryError) as caught:
                await coord.discover()
        reasons = dict(caught.value.reasons)
        assert sorted(reasons) == ["b.policy_model", "b.simple_agent", "b.tools"]
        assert "reports its name as 'tools'" in reasons["b.tools"]
        assert "or give it its Gym deployment's `folder`" in reasons["b.tools"]
        # an agent whose folder holds no policy model: its index would reach no model
        document = union_config(tmp_path, sqlite_url, running, each_in_its_folder(running)).model_dump(
            mode="json"
        )
        for server in document["servers"]:
            if server["name"] in ("b.simple_agent", "b.tools"):
                server["folder"] = "b2"
        config = parse_config(document, base_dir=tmp_path)
        async with Coordinator.open(config) as coord:
            with pytest.raises(DiscoveryError) as caught:
                await coord.discover()
        reasons = dict(caught.value.reasons)
        assert list(reasons) == ["b.simple_agent"]
        assert "in folder 'b2', which holds no policy model" in reasons["b.simple_agent"]


async def test_a_folder_on_a_deployment_reporting_its_config_names_is_fine(
    make_cluster: MakeCluster, tmp_path: Path, sqlite_url: str
) -> None:
    with make_cluster(BASE) as running:
        document = running.config(sqlite_url, tmp_path / "snapshots")
        for server in document["servers"]:
            server["folder"] = "gym-instances/nemo_gym/replica-0"
        async with Coordinator.open(parse_config(document, base_dir=tmp_path)) as coord:
            found = await coord.discover()
            assert [(m.folder, m.reported_name) for m in found.participants] == [
                ("gym-instances/nemo_gym/replica-0", "")
            ] * 3
            attempt = await coord.checkpoint(deadline_s=30)
    assert attempt.snapshot is not None
    assert (attempt.snapshot / "gym-instances/nemo_gym/replica-0/resources/tools/manifest.json").is_file()
    await assert_protocol_ok(sqlite_url)


async def test_a_changed_file_in_one_folder_fails_publish_and_restore_naming_it(
    make_cluster: MakeCluster, tmp_path: Path, sqlite_url: str
) -> None:
    index = f"{agent_instance_dir('simple_agent')}/continuations.jsonl"
    with deployments(make_cluster, "a", "b") as running:
        config = union_config(tmp_path, sqlite_url, running, each_in_its_folder(running))
        async with Coordinator.open(config) as coord:
            await coord.discover()
            attempt = await coord.prepare(deadline_s=30)
            await coord.commit()
            assert attempt.staging_dir is not None
            with (attempt.staging_dir / "b" / index).open("ab") as changed:
                changed.write(b'{"schema_version": 1}\n')
            with pytest.raises(PhaseError) as caught:
                await coord.publish()
            assert caught.value.server == "b.simple_agent"
            assert f"{index} has " in str(caught.value)
            assert "(in folder b)" in str(caught.value)
            assert attempt.state == "aborted"  # rolled back: every server resumed
            published = await coord.checkpoint(deadline_s=30)
    assert published.snapshot is not None
    (published.snapshot / "b/resources/tools/manifest.json").write_text("{}\n")
    with deployments(make_cluster, "a", "b") as fresh:
        async with Coordinator.open(
            union_config(tmp_path, sqlite_url, fresh, each_in_its_folder(fresh))
        ) as coord:
            with pytest.raises(SnapshotError) as refused:
                await coord.restore(published.snapshot)
    assert any(d.startswith("b/resources/tools/manifest.json: ") for d in refused.value.differences)
    assert not [
        e
        for e in await read_events(sqlite_url)
        if e.kind == "call.sent" and e.data["path"].endswith("/restore")
    ]
    await assert_protocol_ok(sqlite_url)


async def test_the_check_flags_a_model_handed_another_folders_index(
    make_cluster: MakeCluster, tmp_path: Path, sqlite_url: str
) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        with deployments(make_cluster, "a", "b") as running:
            config = union_config(tmp_path, sqlite_url, running, each_in_its_folder(running))
            attempt = await save_mid_rollout(running, config, http)
    events = await read_events(sqlite_url)
    assert check_events(events).violations == []
    commits = await commit_calls(sqlite_url, attempt.checkpoint_id, "/commit")
    both = [commits[f"{p}.simple_agent"][1]["continuation_index"] for p in "ab"]

    def changed(server: str, **body: Any) -> list[Event]:
        out = []
        for ev in events:
            if ev.kind == "call.sent" and ev.server == server and ev.data["path"].endswith("/commit"):
                ev = dataclasses.replace(ev, data={**ev.data, "body": {**ev.data["body"], **body}})
            out.append(ev)
        return out

    # what a commit without the per-folder rule sends: every agent's index to every model
    found = check_events(changed("a.policy_model", continuation_indexes=both)).violations
    assert [(v.rule, v.server) for v in found] == [("commit", "a.policy_model")]
    assert "not exactly the 1 the agents of folder 'a' committed" in found[0].message
    # a server sent outside its folder
    staging = attempt.staging_dir
    assert staging is not None
    found = check_events(changed("b.tools", checkpoint_dir=str(staging / "a"))).violations
    assert [(v.rule, v.server) for v in found] == [("commit", "b.tools"), ("commit", "b.tools")]
    assert "not in its folder 'b'" in found[0].message
