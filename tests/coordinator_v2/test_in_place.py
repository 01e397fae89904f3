"""A save committed into a folder of the caller's and published there in place (`into=`), as NeMo RL
needs for its own snapshot folder, against real v2 reference servers and a real SQLite ledger.

The servers write only their folders in it; `quiesce-manifest.json` lists those alone; the caller's
own files are neither listed, read, moved nor removed; nothing goes into quiesce's snapshots folder
or LATEST; a rollback removes what the servers wrote and nothing else; the folder restores like any
snapshot, checked against the ledger.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator import Coordinator, QuiesceError
from quiesce.coordinator.errors import SnapshotError
from quiesce.coordinator.publish import IN_PLACE_MANIFEST, read_latest
from quiesce.tools.gymsim.v2.trainer import Trainer, expected_results, make_tasks
from tests.coordinator.helpers import assert_protocol_ok
from tests.coordinator_v2.helpers import events, phases, sent
from tests.coordinator_v2.test_folders import deployment_spec, union_config

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


def rl_folder(tmp_path: Path) -> Path:
    """A snapshot folder as the trainer has it before the save: its own files already in it."""
    folder = tmp_path / "rl" / "step_7"
    folder.mkdir(parents=True)
    (folder / "trainer_state.pt").write_bytes(b"weights")
    (folder / "gym-instances").mkdir()
    (folder / "gym-instances" / "README").write_text("the trainer's own file beside the deployments\n")
    return folder


async def test_a_save_into_the_callers_folder_restores_exactly(
    v2_cluster: Callable[..., Any], tmp_path: Path, sqlite_url: str, http: httpx.AsyncClient
) -> None:
    tasks = {"d0": make_tasks(3, turns=4, prefix="a"), "d1": make_tasks(2, turns=4, prefix="b")}
    into = rl_folder(tmp_path)
    with v2_cluster(deployment_spec("d0")) as d0, v2_cluster(deployment_spec("d1")) as d1:
        running = {"d0": d0, "d1": d1}
        trainers = {p: Trainer(r.urls[f"{p}.environment"], http=http) for p, r in running.items()}
        for prefix, trainer in trainers.items():
            await trainer.start(tasks[prefix], paced=True)
            await trainer.advance(2)
            await trainer.wait_parked()
        config = union_config(tmp_path, sqlite_url, running)
        async with Coordinator.open(config) as coord:
            async with coord.save(deadline_s=30, into=into) as attempt:
                assert attempt.staging_dir == into
                (into / "written_while_paused.json").write_text("{}")  # the caller's half
            assert attempt.snapshot == into
        for trainer in trainers.values():
            await trainer.detach()
        in_flight = {p: [e.capture_key for e in t.in_flight()] for p, t in trainers.items()}
    # published in place: nothing in quiesce's own snapshots folder, LATEST untouched
    assert read_latest(config.snapshots) is None
    assert (
        not any(p for p in config.snapshots.iterdir() if not p.name.startswith("."))
        if config.snapshots.exists()
        else True
    )
    manifest = json.loads((into / IN_PLACE_MANIFEST).read_text())
    assert manifest["in_place"] is True
    assert manifest["roots"] == ["gym-instances/d0", "gym-instances/d1"]
    listed = [f["path"] for f in manifest["files"]]
    assert len(listed) >= 8  # a manifest and a records file per server, at least
    assert all(p.startswith(("gym-instances/d0/", "gym-instances/d1/")) for p in listed)
    # the caller's files are where they were, unlisted
    assert (into / "trainer_state.pt").read_bytes() == b"weights"
    assert (into / "gym-instances" / "README").is_file()
    published = (await events(sqlite_url, "attempt.published"))[-1].data
    assert published["final_dir"] == str(into)
    started = [
        e for e in await events(sqlite_url, "attempt.started") if e.checkpoint_id == attempt.checkpoint_id
    ]
    assert started[0].data["in_place"] is True
    assert started[0].data["staging_dir"] == str(into)

    # the folder restores like any snapshot — checked against the ledger that published it
    with v2_cluster(deployment_spec("d0")) as f0, v2_cluster(deployment_spec("d1")) as f1:
        fresh = {"d0": f0, "d1": f1}
        async with Coordinator.open(union_config(tmp_path, sqlite_url, fresh)) as coord:
            restore = await coord.restore(into, resume=True)
        assert restore.state == "completed"
        assert restore.warnings == []  # its manifest is the one the ledger recorded
        for prefix, trainer in trainers.items():
            started_again = await trainer.continue_on(fresh[prefix].urls[f"{prefix}.environment"])
            assert sorted(e.capture_key for e in started_again) == sorted(
                f"{k}-a1" for k in in_flight[prefix]
            )
            assert await trainer.wait_results() == expected_results(tasks[prefix])
    for trainer in trainers.values():
        await trainer.aclose()

    # a changed file of the servers' is found; a changed file of the caller's is none of its business
    (into / "trainer_state.pt").write_bytes(b"other weights")
    victim = next(into.glob("gym-instances/d1/gym/agent/*/records-*.jsonl"))
    victim.write_text(victim.read_text() + "\n")
    with v2_cluster(deployment_spec("d0")) as f0, v2_cluster(deployment_spec("d1")) as f1:
        async with Coordinator.open(union_config(tmp_path, sqlite_url, {"d0": f0, "d1": f1})) as coord:
            before = len(await sent(sqlite_url, "restore"))
            with pytest.raises(SnapshotError) as caught:
                await coord.restore(into)
            assert len(await sent(sqlite_url, "restore")) == before
    assert [d for d in caught.value.differences if "differs" in d or "bytes" in d] == [
        d for d in caught.value.differences if victim.name in d
    ]
    assert any(victim.name in d for d in caught.value.differences)
    assert not any("trainer_state" in d for d in caught.value.differences)


async def test_a_rolled_back_save_removes_only_what_the_servers_wrote(
    v2_cluster: Callable[..., Any], tmp_path: Path, sqlite_url: str, http: httpx.AsyncClient, token: str
) -> None:
    into = rl_folder(tmp_path)
    with v2_cluster(deployment_spec("d0")) as d0:
        trainer = Trainer(d0.urls["d0.environment"], http=http)
        await trainer.start(make_tasks(2, turns=3, prefix="a"), paced=True)
        await trainer.wait_parked()
        async with Coordinator.open(union_config(tmp_path, sqlite_url, {"d0": d0})) as coord:
            wrote: list[bool] = []

            async def save_then_fail() -> None:
                async with coord.save(deadline_s=30, into=into):
                    wrote.append((into / "gym-instances" / "d0" / "gym").is_dir())  # the servers' part
                    raise RuntimeError("the trainer's half failed")

            with pytest.raises(RuntimeError, match="the trainer's half failed"):
                await save_then_fail()
            assert wrote == [True]
        assert set((await phases(http, d0.urls, token)).values()) == {"idle"}
        await trainer.aclose()
    assert not (into / "gym-instances" / "d0").exists()
    assert not (into / IN_PLACE_MANIFEST).exists()
    assert (into / "trainer_state.pt").read_bytes() == b"weights"
    assert (into / "gym-instances" / "README").is_file()
    aborted = (await events(sqlite_url, "attempt.aborted"))[-1]
    assert "RuntimeError" in aborted.data["reason"]


async def test_a_folder_that_already_holds_the_servers_folders_is_refused_before_any_request(
    v2_cluster: Callable[..., Any], tmp_path: Path, sqlite_url: str
) -> None:
    into = rl_folder(tmp_path)
    (into / "gym-instances" / "d0").mkdir()
    (into / "gym-instances" / "d0" / "stale").write_text("from an earlier save")
    with v2_cluster(deployment_spec("d0")) as d0:
        async with Coordinator.open(union_config(tmp_path, sqlite_url, {"d0": d0})) as coord:
            await coord.discover()
            with pytest.raises(QuiesceError, match=r"already holds gym-instances/d0, which this save would"):
                await coord.checkpoint(into=into)
            with pytest.raises(QuiesceError, match="overlaps quiesce's snapshots folder"):
                await coord.checkpoint(into=tmp_path / "snapshots" / "mine")
            link = tmp_path / "link"
            link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
            with pytest.raises(QuiesceError, match="is a symlink"):
                await coord.checkpoint(into=link)
    assert await sent(sqlite_url, "prepare") == []
    assert (into / "gym-instances" / "d0" / "stale").read_text() == "from an earlier save"


async def test_a_save_into_a_folder_needs_the_unified_plane(
    tmp_path: Path, sqlite_url: str, token: str
) -> None:
    from quiesce.coordinator import parse_config
    from quiesce.tools.gymsim.cluster import start_cluster

    with start_cluster(None, token=token) as v1:
        config = parse_config(v1.config(sqlite_url, tmp_path / "snapshots"), base_dir=tmp_path)
        async with Coordinator.open(config) as coord:
            with pytest.raises(QuiesceError, match="needs Gym's unified plane; this cluster speaks v1"):
                await coord.checkpoint(into=tmp_path / "rl")
            with pytest.raises(QuiesceError, match=r"in_place=True\) needs Gym's unified plane"):
                await coord.prepare(in_place=True)
    assert not (tmp_path / "rl").exists()


async def test_a_save_prepared_in_place_takes_its_folder_at_commit_and_restores(
    v2_cluster: Callable[..., Any], tmp_path: Path, sqlite_url: str, http: httpx.AsyncClient, token: str
) -> None:
    """NeMo RL's per-actor calls name the folder only at commit: prepare(in_place=True), then
    commit(into=...). The folder is on disk in the ledger before anything is created in it, and a
    ledger read back (what recovery and `resume` use) finds it."""
    from quiesce.coordinator.readback import read_attempt

    into = rl_folder(tmp_path)
    tasks = make_tasks(2, turns=4, prefix="a")
    with v2_cluster(deployment_spec("d0")) as d0:
        trainer = Trainer(d0.urls["d0.environment"], http=http)
        await trainer.start(tasks, paced=True)
        await trainer.advance(2)
        await trainer.wait_parked()
        config = union_config(tmp_path, sqlite_url, {"d0": d0})
        async with Coordinator.open(config) as coord:
            attempt = await coord.prepare(deadline_s=30, in_place=True)
            assert attempt.staging_dir is None
            assert attempt.in_place
            assert not (into / "gym-instances" / "d0").exists()
            await coord.commit(attempt, into=into)
            assert attempt.staging_dir == into
            recorded = await read_attempt(coord.ledger, config, attempt.checkpoint_id)
            assert recorded is not None
            assert recorded.attempt.staging_dir == into
            assert recorded.attempt.in_place
            await coord.publish_and_resume(attempt)
            assert attempt.snapshot == into
        await trainer.detach()
        in_flight = sorted(e.capture_key for e in trainer.in_flight())
    started = [
        e for e in await events(sqlite_url, "attempt.started") if e.checkpoint_id == attempt.checkpoint_id
    ]
    assert started[0].data["in_place"] is True
    assert started[0].data.get("staging_dir") is None
    commit_started = [
        e
        for e in await events(sqlite_url, "phase.started")
        if e.checkpoint_id == attempt.checkpoint_id and e.data["phase"] == "commit"
    ]
    assert [e.data.get("staging_dir") for e in commit_started] == [str(into)]
    first_commit = min(e.seq for e in await sent(sqlite_url, "commit"))
    assert commit_started[0].seq < first_commit
    assert json.loads((into / IN_PLACE_MANIFEST).read_text())["roots"] == ["gym-instances/d0"]
    assert read_latest(config.snapshots) is None
    with v2_cluster(deployment_spec("d0")) as f0:
        async with Coordinator.open(union_config(tmp_path, sqlite_url, {"d0": f0})) as coord:
            restore = await coord.restore(into, resume=True)
        assert restore.state == "completed"
        again = await trainer.continue_on(f0.urls["d0.environment"])
        assert sorted(e.capture_key for e in again) == [f"{k}-a1" for k in in_flight]
        assert await trainer.wait_results() == expected_results(tasks)
    await trainer.aclose()
    await assert_protocol_ok(sqlite_url)  # `check`: the commit's folder is the one recorded


async def test_a_save_prepared_in_place_refuses_a_commit_without_its_folder_and_rolls_back(
    v2_cluster: Callable[..., Any], tmp_path: Path, sqlite_url: str, http: httpx.AsyncClient, token: str
) -> None:
    into = rl_folder(tmp_path)
    (into / "gym-instances" / "d0").mkdir()  # a folder this save would write: refused at commit
    with v2_cluster(deployment_spec("d0")) as d0:
        trainer = Trainer(d0.urls["d0.environment"], http=http)
        await trainer.start(make_tasks(2, turns=3, prefix="a"), paced=True)
        await trainer.wait_parked()
        async with Coordinator.open(union_config(tmp_path, sqlite_url, {"d0": d0})) as coord:
            attempt = await coord.prepare(deadline_s=30, in_place=True)
            with pytest.raises(QuiesceError, match=r"prepared in place with no folder; name it"):
                await coord.commit(attempt)
            assert attempt.state == "aborted"
            assert set((await phases(http, d0.urls, token)).values()) == {"idle"}
            attempt = await coord.prepare(deadline_s=30, in_place=True)
            with pytest.raises(QuiesceError, match=r"already holds gym-instances/d0"):
                await coord.commit(attempt, into=into)
            assert attempt.state == "aborted"
            normal = await coord.prepare(deadline_s=30)
            with pytest.raises(QuiesceError, match=r"give `into` only to an attempt prepared with in_place"):
                await coord.commit(normal, into=into)
            assert normal.state == "aborted"
        assert set((await phases(http, d0.urls, token)).values()) == {"idle"}
        await trainer.aclose()
    assert await sent(sqlite_url, "commit") == []
    await assert_protocol_ok(sqlite_url)
