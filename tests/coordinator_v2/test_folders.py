"""Several Gym deployments in one cluster, each in its own folder of every snapshot (`folder` in the
cluster config), against real v2 reference servers.

NeMo RL runs replicas of one Gym config, so the servers of two deployments report the same
instance names and would write the same `gym/<kind>/<instance>/` folder: each deployment's servers
get their own folder, the snapshot records it per participant, and a restore reads each server's
state from its folder. Two servers that would share a folder and an instance are refused at
discovery; a folder that leaves the snapshot is refused by the config and by the restore's check.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator import ClusterConfig, Coordinator, parse_config
from quiesce.coordinator.errors import ConfigError, DiscoveryError, SnapshotError
from quiesce.tools.audit.cli import check_ledger
from quiesce.tools.gymsim.cluster import RunningCluster
from quiesce.tools.gymsim.spec import default_v2_spec, replica_spec
from quiesce.tools.gymsim.v2.trainer import Trainer, expected_results, make_tasks
from tests.coordinator_v2.helpers import events, sent

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


def deployment_spec(prefix: str) -> dict[str, Any]:
    """The default v2 deployment as replica `prefix` (`replica_spec`): servers `<prefix>.<name>`,
    each still reporting its own name as its instance."""
    return replica_spec(default_v2_spec(), f"{prefix}.").model_dump(mode="json")


def union_config(
    tmp_path: Path, ledger_url: str, deployments: dict[str, RunningCluster], *, folders: bool = True
) -> ClusterConfig:
    """One cluster config over every deployment's servers; with `folders`, deployment `dN` writes
    into `gym-instances/dN`."""
    servers: list[dict[str, Any]] = []
    for prefix, running in deployments.items():
        for name, url in running.urls.items():
            entry: dict[str, Any] = {"name": name, "url": url}
            if folders:
                entry["folder"] = f"gym-instances/{prefix}"
            servers.append(entry)
    document = {"ledger": ledger_url, "snapshots": str(tmp_path / "snapshots"), "servers": servers}
    return parse_config(document, base_dir=tmp_path)


async def test_two_deployments_with_the_same_instances_save_and_restore_exactly_each_in_its_folder(
    v2_cluster: Callable[..., Any], tmp_path: Path, sqlite_url: str, http: httpx.AsyncClient
) -> None:
    tasks = {"d0": make_tasks(3, turns=4, prefix="a"), "d1": make_tasks(3, turns=4, prefix="b")}
    with v2_cluster(deployment_spec("d0")) as d0, v2_cluster(deployment_spec("d1")) as d1:
        running = {"d0": d0, "d1": d1}
        trainers = {p: Trainer(r.urls[f"{p}.environment"], http=http) for p, r in running.items()}
        for prefix, trainer in trainers.items():
            await trainer.start(tasks[prefix], paced=True)
            await trainer.advance(2)
            await trainer.wait_parked()
        async with Coordinator.open(union_config(tmp_path, sqlite_url, running)) as coord:
            found = await coord.discover()
            assert {m.name: m.folder for m in found.participants} == {
                f"{p}.{n}": f"gym-instances/{p}"
                for p in running
                for n in ("environment", "policy_model", "agent", "resources")
            }
            attempt = await coord.checkpoint(deadline_s=30)
        for trainer in trainers.values():
            await trainer.detach()
        in_flight = {p: [e.capture_key for e in t.in_flight()] for p, t in trainers.items()}
    assert attempt.snapshot is not None
    assert attempt.staging_dir is not None
    assert sorted(attempt.scope) == sorted(in_flight["d0"] + in_flight["d1"])
    # each server got its deployment's folder inside the staging folder
    dirs = {ev.server: ev.data["body"]["checkpoint_dir"] for ev in await sent(sqlite_url, "commit")}
    for name, folder in dirs.items():
        assert folder == str(attempt.staging_dir / "gym-instances" / name.split(".")[0])
    # and wrote there, under the instance name it shares with the other deployment's server
    manifest = json.loads((attempt.snapshot / "manifest.json").read_text())
    listed = {entry["path"] for entry in manifest["files"]}
    for prefix in running:
        for kind, instance in (("environment", "environment"), ("agent", "agent"), ("model", "policy_model")):
            own = f"gym-instances/{prefix}/gym/{kind}/{instance}/manifest.json"
            assert own in listed
            assert json.loads((attempt.snapshot / own).read_text())["instance"] == instance
    entries = {p["name"]: p for p in manifest["participants"]}
    assert entries["d1.agent"]["folder"] == "gym-instances/d1"
    assert entries["d1.agent"]["manifest"] == "gym-instances/d1/gym/agent/agent/manifest.json"
    discovered = (await events(sqlite_url, "discovery.completed"))[-1].data["participants"]
    assert {p["name"]: p.get("folder") for p in discovered}["d0.resources"] == "gym-instances/d0"

    # restore into two fresh deployments: each server reads its own folder, every rollout finishes
    with v2_cluster(deployment_spec("d0")) as f0, v2_cluster(deployment_spec("d1")) as f1:
        fresh = {"d0": f0, "d1": f1}
        async with Coordinator.open(union_config(tmp_path, sqlite_url, fresh)) as coord:
            restore = await coord.restore(attempt.snapshot, resume=True)
        assert restore.state == "completed"
        dirs = {ev.server: ev.data["body"]["checkpoint_dir"] for ev in await sent(sqlite_url, "restore")}
        assert dirs == {n: str(attempt.snapshot / "gym-instances" / n.split(".")[0]) for n in dirs}
        assert len(dirs) == 8
        for prefix, trainer in trainers.items():
            started = await trainer.continue_on(fresh[prefix].urls[f"{prefix}.environment"])
            assert sorted(e.capture_key for e in started) == sorted(f"{k}-a1" for k in in_flight[prefix])
            assert await trainer.wait_results() == expected_results(tasks[prefix])
    for trainer in trainers.values():
        await trainer.aclose()
    # the protocol check knows each server's folder: one staging folder, each in its own
    assert (await check_ledger(sqlite_url)).violations == []


async def test_servers_that_would_write_one_folder_are_refused_at_discovery(
    v2_cluster: Callable[..., Any], tmp_path: Path, sqlite_url: str
) -> None:
    with v2_cluster(deployment_spec("d0")) as d0, v2_cluster(deployment_spec("d1")) as d1:
        config = union_config(tmp_path, sqlite_url, {"d0": d0, "d1": d1}, folders=False)
        async with Coordinator.open(config) as coord:
            with pytest.raises(DiscoveryError) as caught:
                await coord.discover()
    text = str(caught.value)
    for name, first in (("d1.agent", "d0.agent"), ("d1.environment", "d0.environment")):
        assert f"{name}: reports kind" in text
        assert f"as {first} does" in text
    assert "give each Gym deployment its own `folder`" in text
    assert "d0.agent: reports" not in text  # the first of each pair is not the one refused


@pytest.mark.parametrize(
    "folder", ["../elsewhere", "/abs", "a//b", "a/./b", ".hidden", "a/", "a\nb", "/".join("abcdefghi")]
)
def test_a_folder_outside_the_snapshot_is_a_config_error(tmp_path: Path, folder: str) -> None:
    document = {"servers": [{"name": "agent", "url": "http://127.0.0.1:9", "folder": folder}]}
    with pytest.raises(ConfigError) as caught:
        parse_config(document, base_dir=tmp_path)
    assert "servers[0].folder" in str(caught.value)
    assert "relative folder" in str(caught.value)


async def test_a_snapshot_naming_a_folder_outside_itself_is_refused_before_any_call(
    v2_cluster: Callable[..., Any], tmp_path: Path, sqlite_url: str, http: httpx.AsyncClient
) -> None:
    with v2_cluster(deployment_spec("d0")) as d0:
        trainer = Trainer(d0.urls["d0.environment"], http=http)
        await trainer.start(make_tasks(2, turns=3, prefix="a"), paced=True)
        await trainer.wait_parked()
        config = union_config(tmp_path, sqlite_url, {"d0": d0})
        async with Coordinator.open(config) as coord:
            attempt = await coord.checkpoint(deadline_s=30)
        await trainer.aclose()
    assert attempt.snapshot is not None
    path = attempt.snapshot / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["participants"][0]["folder"] = "../../elsewhere"
    path.write_text(json.dumps(manifest))
    # a ledger that never saw the snapshot (this one would refuse the changed manifest outright):
    # only the snapshot's own check stands between the folder and the servers
    other = f"sqlite+aiosqlite:///{tmp_path / 'other.db'}"
    with v2_cluster(deployment_spec("d0")) as fresh:
        async with Coordinator.open(union_config(tmp_path, other, {"d0": fresh})) as coord:
            with pytest.raises(SnapshotError) as caught:
                await coord.restore(attempt.snapshot)
    assert await sent(other, "restore") == []
    assert "its folder '../../elsewhere' is not a relative folder" in str(caught.value)
