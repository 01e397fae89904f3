"""RL's per-actor checkpoint methods over quiesce (`quiesce.rl.actors`), driven by a stand-in of
RL's own cross-actor coordinator (`tests/rl/rl_coordinator.py`) through `QuiesceShardSet`'s
handles, the host a real async Ray actor, two real Ray actors standing in for RL's Gym actors
(each a gymsim v2 deployment), a real SQLite ledger and real files:

- save: prepare → renew → commit into RL's folder → RL writes `gym_checkpoint.json` and its half
  → resume publishes in place; one quiesce attempt holds every deployment's calls; `check` and
  the lineage cover the run; a restore into fresh deployments continues exactly what was saved;
- a commit RL did not record (its body failed) is rolled back by the resume RL sends after it;
- a deployment not ready by the deadline answers `prepared=False` with its own blockers, and the
  resume after RL's `NotReady` leaves every server idle;
- a failed restore: RL's cleanup (retire the next attempts, resume) leaves no deployment held;
- the host SIGKILLed mid-commit is restarted by Ray, recovers from the ledger before it answers,
  and RL's retry under a new id succeeds.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import ray
import yaml

from quiesce.coordinator.protocol_v2 import PREFIX
from quiesce.coordinator.publish import IN_PLACE_MANIFEST
from quiesce.ledger import Ledger
from quiesce.ledger.lineage import read_lineage
from quiesce.rl.actors import METHODS, ActorCheckpointHost, InstanceHandle, QuiesceShardSet, as_rl
from quiesce.rl.builder import rl_cluster_config
from quiesce.rl.episodes import (
    CommitSummary,
    Episode,
    ParticipantCommitSummary,
    ParticipantManifest,
    PrepareSummary,
)
from quiesce.rl.errors import EnvironmentCheckpointError
from quiesce.rl.gym_manifest import GymCheckpointManifest
from quiesce.tools.audit.cli import check_ledger
from quiesce.tools.gymsim.v2.trainer import expected_results, make_tasks
from tests.cli.helpers import json_of, quiesce
from tests.rl.conftest import ROOT, ShardSet, StartActors, env_handles
from tests.rl.rl_coordinator import NotReady, OperationError, RLCoordinator, RLNightlyTypes, RLTypes
from tests.rl.test_host import events, ledger_of, phases, started, write_config

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300), pytest.mark.usefixtures("ray_local")]

INSTANCES = ("nemo_gym/replica-0", "nemo_gym/replica-1")


def host_actor(config: Path, token: str, **options: Any) -> Any:
    """The host as RL would run it: an async Ray actor (the token an argument, never an env var)."""
    options = {"max_restarts": 0, **options}
    return ray.remote(**options)(ActorCheckpointHost).remote(str(config), token=token)


async def candidates(shards: ShardSet) -> dict[str, tuple[Episode, ...]]:
    """RL's inventory: each instance's episodes in flight."""
    return {
        i: tuple(sorted(Episode.coerce(e) for e in await h.in_flight.remote()))
        for i, h in shards.checkpoint_handles.items()
    }


async def parked(shards: ShardSet, tasks: dict[str, dict[str, Any]]) -> None:
    for instance, handle in shards.checkpoint_handles.items():
        await handle.start_episodes.remote(tasks[instance], paced=True)
        await handle.advance.remote(2)
        await handle.wait_parked.remote()


def tasks_for() -> dict[str, dict[str, Any]]:
    return {
        INSTANCES[0]: make_tasks(3, turns=4, prefix="a"),
        INSTANCES[1]: make_tasks(2, turns=4, prefix="b"),
    }


@dataclass
class Run:
    """Two parked deployments, the host over them, RL's coordinator over the host, RL's folder."""

    shards: ShardSet
    config: Path
    host: Any
    rl: RLCoordinator
    root: Path


async def rl_over_quiesce(
    gym_actors: StartActors, tmp_path: Path, token: str, step: str, **host_options: Any
) -> Run:
    shards = await gym_actors("v2")
    await parked(shards, tasks_for())
    config = await write_config(shards, tmp_path)
    host = host_actor(config, token, **host_options)
    await started(host)
    rl = RLCoordinator(QuiesceShardSet.over(host, INSTANCES), control_timeout_s=30)
    root = tmp_path / "rl" / step
    root.mkdir(parents=True)
    return Run(shards, config, host, rl, root)


def test_the_handles_have_rls_method_signatures() -> None:
    """Each handle method takes RL's arguments after the instance the host adds."""
    for name in METHODS:
        params = list(inspect.signature(getattr(ActorCheckpointHost, name)).parameters.values())
        assert params[1].name == "instance_id"
        assert params[-1].name == "deadline_ts"
        assert params[-1].kind is inspect.Parameter.KEYWORD_ONLY
    restore = inspect.signature(ActorCheckpointHost.checkpoint_restore).parameters
    assert restore["source_checkpoint_id"].kind is inspect.Parameter.KEYWORD_ONLY
    handles = QuiesceShardSet.over("host", INSTANCES).checkpoint_handles
    assert list(handles) == list(INSTANCES)
    with pytest.raises(AttributeError):
        _ = handles[INSTANCES[0]].checkpoint_publish


def test_values_are_rebuilt_as_rls_own_classes_with_every_field() -> None:
    manifest = ParticipantManifest(1, "model", "policy_model", "q1-2-e3", "records-1.jsonl", "a" * 64, 2)
    ours = CommitSummary(
        exported_episodes=(Episode("r1", 0), Episode("r2", 1)),
        staging_keys=("k1", "k2"),
        participants=(
            ParticipantCommitSummary("policy_model", "model", "committed", ("r1",), manifest, ("k1", "k2")),
        ),
        staging_keys_by_episode={Episode("r1", 0): ("k1",), Episode("r2", 1): ("k2",)},
    )
    theirs = as_rl(ours, RLTypes)
    assert type(theirs) is RLTypes.GymCheckpointCommitSummary
    assert theirs.exported_episodes == (
        RLTypes.GymCheckpointEpisode("r1", 0),
        RLTypes.GymCheckpointEpisode("r2", 1),
    )
    assert theirs.staging_keys_by_episode == {
        RLTypes.GymCheckpointEpisode("r2", 1): ("k2",),
        RLTypes.GymCheckpointEpisode("r1", 0): ("k1",),
    }
    (participant,) = theirs.participants
    assert type(participant.manifest) is RLTypes.GymCheckpointParticipantManifest
    assert dataclasses.asdict(participant.manifest) == dataclasses.asdict(manifest)
    assert (
        participant.server_name,
        participant.kind,
        participant.capture_keys,
        participant.staging_keys,
    ) == (
        "policy_model",
        "model",
        ("r1",),
        ("k1", "k2"),
    )
    nightly = as_rl(ours, RLNightlyTypes)  # participants as names; no unowned_live_episodes field
    assert type(nightly) is RLNightlyTypes.GymCheckpointCommitSummary
    assert nightly.participants == ("policy_model",)
    assert nightly.staging_keys_by_episode == theirs.staging_keys_by_episode
    prepared = as_rl(PrepareSummary(False, {"environment": ("b0",)}), RLTypes)
    assert prepared == RLTypes.GymCheckpointPrepareSummary(False, {"environment": ("b0",)})
    assert as_rl(None, RLTypes) is None  # renew, retire, restore and resume answer nothing


async def test_a_transient_failure_reaches_rl_as_its_unavailable_type_and_others_as_they_are() -> None:
    """RL retries a failed operation only when every failure is its `GymCheckpointUnavailable` (or
    infrastructure): given RL's types, a transient quiesce failure is raised as that type."""

    not_ready = EnvironmentCheckpointError(
        "servers not ready", operation="prepare", code="not_ready", transient=True
    )
    handle = InstanceHandle(Failing(not_ready), INSTANCES[0], RLTypes)
    with pytest.raises(RLTypes.GymCheckpointUnavailable, match="servers not ready") as caught:
        await handle.checkpoint_prepare.remote("c1", deadline_ts=time.time() + 5)
    assert caught.value.__cause__ is not_ready
    broken = EnvironmentCheckpointError(
        "a reply was malformed", operation="commit", code="malformed_reply", transient=False
    )
    handle = InstanceHandle(Failing(broken), INSTANCES[0], RLTypes)
    with pytest.raises(EnvironmentCheckpointError) as raised:
        await handle.checkpoint_commit.remote("c1", "/root", (), deadline_ts=time.time() + 5)
    assert raised.value is broken
    plain = InstanceHandle(Failing(not_ready), INSTANCES[0])  # no RL types: quiesce's error as it is
    with pytest.raises(EnvironmentCheckpointError):
        await plain.checkpoint_prepare.remote("c1", deadline_ts=time.time() + 5)


class Failing:
    """A host whose every method raises `error` (what a Ray actor's method raising it looks like
    once awaited)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __getattr__(self, name: str) -> Any:
        async def method(*args: Any, **kwargs: Any) -> None:
            raise self.error

        return method


async def test_rls_coordinator_over_quiesce_saves_into_its_folder_and_restores_exactly(
    gym_actors: StartActors, tmp_path: Path, token: str
) -> None:
    tasks = tasks_for()
    shards = await gym_actors("v2")
    await parked(shards, tasks)
    config = await write_config(shards, tmp_path)
    url = ledger_of(config)
    host = host_actor(config, token)
    assert await started(host) == {"attempts": [], "instances": list(INSTANCES)}
    # RL's own classes answered, as its coordinator checks the commit summary with isinstance
    rl = RLCoordinator(
        QuiesceShardSet.over(host, INSTANCES, types=RLTypes),
        control_timeout_s=30,
        summary_type=RLTypes.GymCheckpointCommitSummary,
    )
    root = tmp_path / "rl" / "step_3"
    root.mkdir(parents=True)
    inventory = await candidates(shards)
    async with rl.prepared("rl-step-3"):
        manifest, summaries = await rl.commit("rl-step-3", root, inventory)
        (root / "tq.pt").write_bytes(b"RL's half")
        # not published yet: RL's half is written while every server is still paused
        assert not (root / IN_PLACE_MANIFEST).exists()
    assert [op for op, _ in rl.calls] == ["prepare"] * 2 + ["renew"] * 2 + ["commit"] * 2 + ["resume"] * 2
    # each instance got its own part: its servers, its episodes, its model's staging keys
    for instance in INSTANCES:
        summary = summaries[instance]
        assert isinstance(summary, RLTypes.GymCheckpointCommitSummary)
        assert isinstance(summary.participants[0].manifest, RLTypes.GymCheckpointParticipantManifest)
        assert tuple(Episode.coerce(e) for e in summary.exported_episodes) == inventory[instance]
        assert {p.server_name for p in summary.participants} == {
            "agent",
            "environment",
            "policy_model",
            "resources",
        }
        assert {p.manifest.checkpoint_id for p in summary.participants} == {
            summary.participants[0].manifest.checkpoint_id
        }
        assert manifest.staging_keys[instance]
    assert manifest.checkpoint_id == "rl-step-3"
    assert GymCheckpointManifest.load(root) == manifest
    published = json.loads((root / IN_PLACE_MANIFEST).read_text())
    assert published["roots"] == [f"gym-instances/{i}" for i in INSTANCES]
    assert set((await phases(shards, token)).values()) == {"idle"}
    # one quiesce attempt for RL's id, both deployments' calls in it, the folder named at commit
    every = await events(url)
    saves = [e for e in every if e.kind == "attempt.started"]
    assert len(saves) == 1
    cid = saves[0].checkpoint_id
    commits = [e for e in every if e.kind == "call.sent" and e.data["path"].endswith("/commit")]
    assert sorted(e.server for e in commits) == sorted(
        s["name"] for s in yaml.safe_load(config.read_text())["servers"]
    )
    assert [
        e.data.get("staging_dir")
        for e in every
        if e.kind == "phase.started" and e.checkpoint_id == cid and e.data["phase"] == "commit"
    ] == [str(root)]
    states = {i: await h.episodes_state.remote() for i, h in shards.checkpoint_handles.items()}
    for handle in shards.checkpoint_handles.values():
        await handle.detach.remote()
    await host.close.remote()
    ray.kill(host)

    # RL restarts: fresh deployments, a fresh host over the same ledger, RL's restore → resume
    fresh = await gym_actors("v2")
    (tmp_path / "again").mkdir()
    config2 = await write_config(fresh, tmp_path / "again")
    config2.write_text(yaml.safe_dump({**yaml.safe_load(config2.read_text()), "ledger": url}))
    host2 = host_actor(config2, token)
    await started(host2)
    rl2 = RLCoordinator(QuiesceShardSet.over(host2, INSTANCES), control_timeout_s=30)
    loaded = GymCheckpointManifest.load(root)
    await rl2.restore("rl-restore-1", root, loaded)
    await rl2.resume("rl-restore-1")
    for instance, handle in fresh.checkpoint_handles.items():
        continued = await handle.continue_episodes.remote(states[instance])
        assert sorted(Episode.coerce(e) for e in continued) == sorted(loaded.next_attempts()[instance])
        assert await handle.wait_results.remote() == expected_results(tasks[instance])
    await host2.close.remote()
    report = await check_ledger(url)
    assert report.violations == []
    # the CLI over the run's one ledger: every rollout of both deployments, continued once
    shown = json_of(quiesce("rollouts", "--ledger", url, "--json", cwd=tmp_path))
    assert {(r["rollout_id"], r["state"], r["attempt"]) for r in shown["rollouts"]} == {
        (e.rollout_id, "live", 1) for e in loaded.episodes()
    }
    checked = quiesce("check", "--ledger", url, "--json", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert json_of(checked)["violations"] == []
    async with Ledger.open(url, readonly=True) as ledger:
        lineage = await read_lineage(ledger)
    assert {r: (x.attempt, x.state) for r, x in lineage.rollouts.items()} == {
        e.rollout_id: (1, "live") for e in loaded.episodes()
    }


async def test_a_commit_rl_did_not_record_is_rolled_back_by_its_resume(
    gym_actors: StartActors, tmp_path: Path, token: str
) -> None:
    run = await rl_over_quiesce(gym_actors, tmp_path, token, "step_4")
    shards, config, host, rl, root = run.shards, run.config, run.host, run.rl, run.root
    (root / "tq.pt").write_bytes(b"RL")
    inventory = await candidates(shards)

    async def commit_then_fail() -> None:
        async with rl.prepared("rl-step-4"):
            # RL's own commit step fails after Gym committed, before gym_checkpoint.json is written
            handles = QuiesceShardSet.over(host, INSTANCES).checkpoint_handles
            deadline = time.time() + 30

            async def commit(instance: str) -> None:
                await handles[instance].checkpoint_commit.remote(
                    "rl-step-4", str(root), inventory[instance], deadline_ts=deadline
                )

            async with anyio.create_task_group() as tg:
                for instance in handles:
                    tg.start_soon(commit, instance)
            assert (root / "gym-instances" / INSTANCES[0]).is_dir()  # Gym committed
            raise RuntimeError("RL's transfer queue could not be saved")

    with pytest.raises(RuntimeError, match="transfer queue"):
        await commit_then_fail()
    assert set((await phases(shards, token)).values()) == {"idle"}
    assert sorted(p.name for p in root.iterdir()) == ["tq.pt"]
    assert not (root / IN_PLACE_MANIFEST).exists()
    ended = [e for e in await events(ledger_of(config)) if e.kind in ("attempt.aborted", "attempt.completed")]
    assert ended[-1].kind == "attempt.aborted"
    assert "wrote no gym_checkpoint.json" in ended[-1].data["reason"]
    await host.close.remote()


async def test_a_deployment_not_ready_answers_its_own_blockers_and_rls_resume_frees_everyone(
    gym_actors: StartActors, tmp_path: Path, token: str
) -> None:
    shards = await gym_actors("v2")
    handles = shards.checkpoint_handles
    await handles[INSTANCES[0]].start_episodes.remote(make_tasks(2, turns=4, prefix="a"), paced=True)
    await handles[INSTANCES[0]].advance.remote(1)
    await handles[INSTANCES[0]].wait_parked.remote()
    # replica 1's episode is held mid-turn: its environment cannot park it
    await handles[INSTANCES[1]].start_episodes.remote(make_tasks(1, turns=4, prefix="b"), paced=True)
    await handles[INSTANCES[1]].wait_parked.remote()
    await handles[INSTANCES[1]].hold_mid_turn.remote(["b0"])
    # the host built from RL's own arguments: its deployments found through Ray when it starts
    master_config = {
        "quiesce": {
            "ledger": f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}",
            "snapshots": str(tmp_path / "snapshots"),
            "deadline_s": 30,
        }
    }
    config = rl_cluster_config(master_config, env_handles=env_handles(shards, math=object()))
    host: Any = ray.remote(max_restarts=0)(ActorCheckpointHost).remote(config, token=token)
    assert (await started(host))["instances"] == list(INSTANCES)
    rl = RLCoordinator(QuiesceShardSet.over(host, INSTANCES), control_timeout_s=2)
    with pytest.raises(NotReady) as caught:
        async with rl.prepared("rl-step-5"):
            raise AssertionError("never prepared")
    blockers = caught.value.blockers
    # one attempt for the run: nobody is held once it failed; only replica 1 names blockers
    assert sorted(blockers) == list(INSTANCES)
    assert blockers[INSTANCES[0]] == {}
    assert any("b0" in key for keys in blockers[INSTANCES[1]].values() for key in keys)
    assert set((await phases(shards, token)).values()) == {"idle"}
    assert [op for op, _ in rl.calls] == ["prepare", "prepare", "resume", "resume"]
    with pytest.raises(ray.exceptions.RayTaskError, match="has ended"):  # an id is spent once resumed
        await host.checkpoint_prepare.remote(INSTANCES[0], "rl-step-5", deadline_ts=time.time() + 5)
    await handles[INSTANCES[1]].release.remote()
    await host.close.remote()


async def test_a_failed_restore_is_cleaned_up_by_rls_retire_and_resume(
    gym_actors: StartActors, tmp_path: Path, token: str
) -> None:
    run = await rl_over_quiesce(gym_actors, tmp_path, token, "step_6")
    shards, config, host, rl, root = run.shards, run.config, run.host, run.rl, run.root
    async with rl.prepared("rl-step-6"):
        manifest, _ = await rl.commit("rl-step-6", root, await candidates(shards))
    # into the same, used deployments: Gym refuses a restore into servers holding live episodes
    with pytest.raises(OperationError) as caught:
        await rl.restore("rl-restore-6", root, manifest)
    assert set(caught.value.failures) == set(INSTANCES)
    assert [op for op, _ in rl.calls][-6:] == ["restore"] * 2 + ["restore_cleanup"] * 2 + ["resume"] * 2
    assert set((await phases(shards, token)).values()) == {"idle"}
    await host.close.remote()
    report = await check_ledger(ledger_of(config))
    assert [v for v in report.violations if not v.rule.startswith("lineage")] == []


async def test_the_host_killed_mid_commit_recovers_when_restarted_and_rls_retry_succeeds(
    gym_actors: StartActors, tmp_path: Path, token: str
) -> None:
    run = await rl_over_quiesce(gym_actors, tmp_path, token, "step_7", max_restarts=1, max_task_retries=0)
    shards, host, rl, root = run.shards, run.host, run.rl, run.root
    url = ledger_of(run.config)
    agent_url = (await shards.checkpoint_handles[INSTANCES[1]].urls.remote())["agent"]
    slow = {"kind": "delay", "path": f"{PREFIX}/commit", "seconds": 5.0, "when": "during", "times": 1}
    async with httpx.AsyncClient(trust_env=False) as http:
        assert (
            await http.post(f"{agent_url}/gymsim/admin/faults", json={"faults": [slow]})
        ).status_code == 200
    inventory = await candidates(shards)
    failures: list[BaseException] = []

    async def save() -> None:
        try:
            async with rl.prepared("rl-step-7"):
                await rl.commit("rl-step-7", root, inventory)
        except Exception as error:
            failures.append(error)

    async with anyio.create_task_group() as tg:
        tg.start_soon(save)
        for _ in range(150):
            if any(e.kind == "call.sent" and e.data["path"].endswith("/commit") for e in await events(url)):
                break
            await anyio.sleep(0.2)
        await anyio.sleep(0.5)
        ray.kill(host, no_restart=False)
    assert len(failures) == 1
    assert isinstance(failures[0], OperationError)
    dead = [e for e in await events(url) if e.kind == "attempt.started"][-1].checkpoint_id
    recovered = await started(host)
    assert recovered["attempts"] == [{"checkpoint_id": dead, "action": "resumed"}]
    assert set((await phases(shards, token)).values()) == {"idle"}
    assert not (root / "gym-instances" / INSTANCES[0]).exists()
    # RL retries under a new id: it goes through
    async with rl.prepared("rl-step-7b"):
        manifest, _ = await rl.commit("rl-step-7b", root, inventory)
    assert {e.capture_key for e in manifest.episodes()} == {
        e.capture_key for eps in inventory.values() for e in eps
    }
    assert (root / IN_PLACE_MANIFEST).is_file()
    await host.close.remote()
    report = await check_ledger(url)
    assert [v for v in report.violations if not v.rule.startswith("lineage")] == []


async def test_the_host_killed_between_commit_and_resume_leaves_nothing_paused_after_recover(
    gym_actors: StartActors, tmp_path: Path, token: str
) -> None:
    """No restart this time (the driver and its actors gone, as when RL's job dies): the servers
    stay paused under the dead host's checkpoint until `quiesce recover` rolls it back — RL never
    recorded it, so nothing of Gym's stays in RL's folder."""
    run = await rl_over_quiesce(gym_actors, tmp_path, token, "step_8")
    inventory = await candidates(run.shards)

    async def save_while_the_host_dies() -> None:
        async with run.rl.prepared("rl-step-8"):
            await run.rl.commit("rl-step-8", run.root, inventory)
            (run.root / "tq.pt").write_bytes(b"RL's half")
            ray.kill(run.host, no_restart=True)  # the host's process dies before RL's resume

    with pytest.raises(OperationError) as caught:
        await save_while_the_host_dies()
    assert caught.value.operation in ("renew", "resume")
    held = await phases(run.shards, token)
    assert set(held.values()) == {"committed"}, held
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-m", "quiesce", "recover", "--config", str(run.config), "--json"],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    cid = [e for e in await events(ledger_of(run.config)) if e.kind == "attempt.started"][-1].checkpoint_id
    assert [(a["checkpoint_id"], a["action"]) for a in json.loads(done.stdout)["attempts"]] == [
        (cid, "resumed")
    ]
    assert set((await phases(run.shards, token)).values()) == {"idle"}
    # recovery found the folder the commit named (recorded before anything was made in it)
    assert not (run.root / "gym-instances").exists()
    assert (run.root / "tq.pt").read_bytes() == b"RL's half"
    report = await check_ledger(ledger_of(run.config))
    assert [v for v in report.violations if not v.rule.startswith("lineage")] == []


async def test_renewals_during_a_slow_commit_keep_every_deployment_and_a_spent_id_is_refused(
    gym_actors: StartActors, tmp_path: Path, token: str
) -> None:
    """RL renews in the background while its body runs, the commit included: with a 3 s control
    timeout it renews every second, while one agent takes 2.5 s over its commit."""
    run = await rl_over_quiesce(gym_actors, tmp_path, token, "step_9")
    rl = RLCoordinator(QuiesceShardSet.over(run.host, INSTANCES), control_timeout_s=3)
    agent_url = (await run.shards.checkpoint_handles[INSTANCES[0]].urls.remote())["agent"]
    slow = {"kind": "delay", "path": f"{PREFIX}/commit", "seconds": 2.5, "when": "during", "times": 1}
    async with httpx.AsyncClient(trust_env=False) as http:
        assert (
            await http.post(f"{agent_url}/gymsim/admin/faults", json={"faults": [slow]})
        ).status_code == 200
    inventory = await candidates(run.shards)
    async with rl.prepared("rl-step-9"):
        manifest, _ = await rl.commit("rl-step-9", run.root, inventory)
        await anyio.sleep(1.5)  # RL's own half, while the renewals go on
    assert (run.root / IN_PLACE_MANIFEST).is_file()
    assert {e.capture_key for e in manifest.episodes()} == {
        e.capture_key for eps in inventory.values() for e in eps
    }
    url = ledger_of(run.config)
    every = await events(url)
    renews = [e for e in every if e.kind == "call.sent" and e.data["path"].endswith("/renew")]
    commits = [e for e in every if e.kind == "call.sent" and e.data["path"].endswith("/commit")]
    committed = next(e.seq for e in every if e.kind == "phase.completed" and e.data["phase"] == "commit")
    assert any(min(c.seq for c in commits) < r.seq < committed for r in renews)  # during the commit
    assert set((await phases(run.shards, token)).values()) == {"idle"}
    with pytest.raises(ray.exceptions.RayTaskError, match="has ended"):
        await run.host.checkpoint_prepare.remote(INSTANCES[0], "rl-step-9", deadline_ts=time.time() + 5)
    await run.host.close.remote()
    report = await check_ledger(url)
    assert [v for v in report.violations if not v.rule.startswith("lineage")] == []


async def test_a_restore_whose_instances_name_different_sources_is_refused_before_any_request(
    gym_actors: StartActors, tmp_path: Path, token: str
) -> None:
    run = await rl_over_quiesce(gym_actors, tmp_path, token, "step_10")
    deadline = time.time() + 10
    calls = [
        run.host.checkpoint_restore.remote(
            instance, "rl-restore-10", str(run.root), (), source_checkpoint_id=source, deadline_ts=deadline
        )
        for instance, source in zip(INSTANCES, ("rl-step-1", "rl-step-2"), strict=True)
    ]
    for call in calls:
        with pytest.raises(ray.exceptions.RayTaskError, match="different checkpoint roots or sources"):
            await call
    assert not any(e.kind == "attempt.started" for e in await events(ledger_of(run.config)))
    await run.host.close.remote()
