"""A real coordinator process SIGKILLed mid-save and mid-restore on Gym's unified plane (v2), then
recovered from the ledger by `quiesce recover` — against real v2 reference servers (uvicorn, on
loopback) with episodes running, the default 600 s lease grace (a recovery that waited for a lease
would time out here), a real SQLite ledger.

Each kill is a `quiesce` process (`tests/recovery/v2_kill_child.py`) that SIGKILLs itself at one
instant: during prepare (environment and policy model prepared, the agent's prepare not sent);
after every commit reply was verified, right before the rename that publishes; after the rename,
before the first resume; mid-restore (two restores sent, two not); after a restore, before the
resume its caller asked for. Then: the action recovery took from the ledger (rolled back, finished,
cleaned up), every server where it must be, nothing published half-way, no staging left, no lease
expired, a second `quiesce recover` that makes no call and appends only its start and finish, the
ledger's replay and protocol check — and the episodes finish exactly as an uninterrupted run
(`expected_results`), on the same servers or, after a restore, as their next attempts.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest

from quiesce.coordinator.protocol import TOKEN_ENV, TOKEN_ENV_FALLBACK
from quiesce.coordinator.publish import load_snapshot, read_latest
from quiesce.ledger import Ledger, replay_url
from quiesce.tools.audit.cli import check_ledger
from quiesce.tools.gymsim.cluster import IMPORT_ROOT, RunningCluster, start_cluster, write_yaml_atomic
from quiesce.tools.gymsim.spec import default_v2_spec
from quiesce.tools.gymsim.v2.trainer import Trainer, expected_results, make_tasks
from tests.oracle.wire import Violations
from tests.recovery.v2_kill_child import VARIABLE

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

NAMES = ("environment", "policy_model", "agent", "resources")
#: how long the resources server's restore is held in the half-way restore
DELAY_S = 3.0
RECOVERY_FRAME = ["coordinator.started", "recovery.started", "recovery.completed"]


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    value = "qz2k-" + os.urandom(12).hex()
    monkeypatch.setenv(TOKEN_ENV, value)
    monkeypatch.delenv(TOKEN_ENV_FALLBACK, raising=False)
    return value


@pytest.fixture
def ledger_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        yield client


class Cluster:
    """A running v2 reference cluster and its config file."""

    def __init__(self, running: RunningCluster, config: Path, snapshots: Path) -> None:
        self.running = running
        self.urls = running.urls
        self.config = config
        self.snapshots = snapshots


@pytest.fixture
def v2(tmp_path: Path, token: str, ledger_url: str) -> Callable[[str], AbstractContextManager[Cluster]]:
    """`with v2(name) as cluster`: a fresh v2 cluster (default spec) writing its config beside."""

    @contextlib.contextmanager
    def make(name: str) -> Iterator[Cluster]:
        with start_cluster(default_v2_spec(), token=token) as running:
            snapshots = tmp_path / "snapshots"
            config = write_yaml_atomic(tmp_path / f"{name}.yaml", running.config(ledger_url, snapshots))
            yield Cluster(running, config, snapshots)

    return make


# ---------------------------------------------------------------------------------------------
# Processes and state
# ---------------------------------------------------------------------------------------------


def _run(argv: list[str], *, kill: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(IMPORT_ROOT)}
    module = "quiesce"
    if kill is not None:
        env[VARIABLE] = json.dumps(kill)
        module = "tests.recovery.v2_kill_child"
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=str(IMPORT_ROOT),
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


async def quiesce(*argv: str, kill: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    return await anyio.to_thread.run_sync(lambda: _run(list(argv), kill=kill))


async def killed(*argv: str, kill: dict[str, Any]) -> None:
    """Run a `quiesce` command that must die by SIGKILL at `kill`."""
    done = await quiesce(*argv, kill=kill)
    assert done.returncode == -9, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "v2_kill_child:" in done.stderr


async def recover(cluster: Cluster) -> dict[str, Any]:
    done = await quiesce("recover", "--config", str(cluster.config), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    document: dict[str, Any] = json.loads(done.stdout)
    return document


async def state(http: httpx.AsyncClient, cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {n: (await http.get(cluster.urls[n] + "/gymsim/admin/state")).json() for n in NAMES}


async def phases(http: httpx.AsyncClient, cluster: Cluster) -> dict[str, tuple[str, str | None]]:
    return {n: (s["phase"], s["checkpoint_id"]) for n, s in (await state(http, cluster)).items()}


async def control_calls(http: httpx.AsyncClient, cluster: Cluster) -> int:
    total = 0
    for name in NAMES:
        total += len((await http.get(cluster.urls[name] + "/gymsim/admin/control-log")).json())
    return total


async def events(url: str, after: int = 0) -> list[Any]:
    async with Ledger.open(url, readonly=True) as ledger:
        return [ev async for ev in ledger.read(after=after)]


async def assert_second_recover_is_a_no_op(http: httpx.AsyncClient, cluster: Cluster, url: str) -> None:
    head = (await events(url))[-1].seq
    calls = await control_calls(http, cluster)
    document = await recover(cluster)
    assert document["attempts"] == []
    assert [ev.kind for ev in await events(url, head)] == RECOVERY_FRAME
    assert await control_calls(http, cluster) == calls


async def assert_no_lease_expired(http: httpx.AsyncClient, cluster: Cluster) -> None:
    assert {n: s["lease_expirations"] for n, s in (await state(http, cluster)).items()} == dict.fromkeys(
        NAMES, 0
    )


async def assert_ledger_ok(url: str) -> None:
    replayed = await replay_url(url)
    assert replayed.ok, (replayed.problem, replayed.differences[:3])
    report = await check_ledger(url)
    assert report.violations == []


def published_folders(snapshots: Path) -> list[str]:
    if not snapshots.is_dir():
        return []
    return sorted(p.name for p in snapshots.iterdir() if p.is_dir() and not p.name.startswith("."))


def staging_left(snapshots: Path) -> list[str]:
    staging = snapshots / ".staging"
    return sorted(p.name for p in staging.iterdir()) if staging.is_dir() else []


async def parked_trainer(http: httpx.AsyncClient, cluster: Cluster, tasks: dict[str, Any]) -> Trainer:
    """Episodes started on the cluster, two turns run, parked at that boundary."""
    trainer = Trainer(cluster.urls["environment"], http=http)
    await trainer.start(tasks, paced=True)
    await trainer.advance(2)
    await trainer.wait_parked()
    return trainer


# ---------------------------------------------------------------------------------------------
# Saves
# ---------------------------------------------------------------------------------------------

#: where a `quiesce checkpoint` dies, and what recovery must then do with its attempt
SAVE_KILLS = {
    # the environment and the policy model prepared; the agent's prepare never left
    "during prepare": ({"kind": "call.sent", "server": "agent", "path": "/checkpoint/prepare"}, "resumed"),
    # every commit replied and verified; the rename that publishes never ran
    "after commit, before publish": ({"kind": "attempt.publishing", "when": "staged"}, "resumed"),
    # renamed into place (published); the first resume never left
    "after publish, before resume": ({"kind": "call.sent", "path": "/checkpoint/resume"}, "published"),
}


@pytest.mark.parametrize("where", list(SAVE_KILLS))
async def test_a_save_killed_mid_way_is_rolled_back_or_finished_from_the_ledger(
    where: str, v2: Any, ledger_url: str, http: httpx.AsyncClient
) -> None:
    kill, action = SAVE_KILLS[where]
    tasks = make_tasks(4, turns=5)
    with v2("cluster") as cluster:
        trainer = await parked_trainer(http, cluster, tasks)
        await killed("checkpoint", "--config", str(cluster.config), "--json", kill=kill)
        before = await phases(http, cluster)
        assert any(phase != "idle" for phase, _ in before.values()), before  # it held them when it died
        started = [ev for ev in await events(ledger_url) if ev.kind == "attempt.started"]
        cid = started[-1].checkpoint_id
        document = await recover(cluster)
        assert [(a["checkpoint_id"], a["action"]) for a in document["attempts"]] == [(cid, action)]
        assert await phases(http, cluster) == dict.fromkeys(NAMES, ("idle", None))
        await assert_no_lease_expired(http, cluster)
        kinds = [ev.kind for ev in await events(ledger_url) if ev.checkpoint_id == cid]
        # nothing published half-way: a snapshot exists exactly when the rename happened
        if action == "published":
            assert "attempt.published" in kinds
            latest = read_latest(cluster.snapshots)
            assert latest is not None
            assert load_snapshot(latest).checkpoint_id == cid
            assert published_folders(cluster.snapshots) == [latest.name]
            assert "attempt.completed" in kinds
            assert "attempt.aborted" not in kinds
        else:
            assert "attempt.published" not in kinds
            assert published_folders(cluster.snapshots) == []
            assert kinds[-1] == "attempt.aborted"
        assert staging_left(cluster.snapshots) == []
        await assert_second_recover_is_a_no_op(http, cluster, ledger_url)
        # the episodes run on, on the same servers, and finish as an uninterrupted run
        await trainer.unpace()
        assert await trainer.wait_results() == expected_results(tasks)
    await assert_ledger_ok(ledger_url)


#: where a `quiesce checkpoint --into FOLDER` (published in place, in the trainer's folder) dies
IN_PLACE_KILLS = {
    # every commit verified; the publish step began, its manifest not written yet
    "in place, before the manifest": (
        {"kind": "phase.started", "phase": "publish", "when": "staged"},
        "resumed",
    ),
    # the manifest is on disk (the commit point); the ledger has no word of it yet
    "in place, after the manifest": ({"kind": "attempt.publishing", "when": "staged"}, "published"),
}


@pytest.mark.parametrize("where", list(IN_PLACE_KILLS))
async def test_a_save_into_the_trainers_folder_killed_mid_way_is_settled_from_the_folder(
    where: str, v2: Any, ledger_url: str, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    kill, action = IN_PLACE_KILLS[where]
    tasks = make_tasks(3, turns=5)
    into = tmp_path / "trainer" / "step_3"
    into.mkdir(parents=True)
    (into / "trainer_state.pt").write_bytes(b"the trainer's half")
    with v2("cluster") as cluster:
        trainer = await parked_trainer(http, cluster, tasks)
        await killed("checkpoint", "--config", str(cluster.config), "--into", str(into), kill=kill)
        cid = [ev for ev in await events(ledger_url) if ev.kind == "attempt.started"][-1].checkpoint_id
        document = await recover(cluster)
        assert [(a["checkpoint_id"], a["action"]) for a in document["attempts"]] == [(cid, action)]
        assert await phases(http, cluster) == dict.fromkeys(NAMES, ("idle", None))
        await assert_no_lease_expired(http, cluster)
        kinds = [ev.kind for ev in await events(ledger_url) if ev.checkpoint_id == cid]
        if action == "published":  # read from the folder: its manifest names the attempt
            published = [ev for ev in await events(ledger_url) if ev.kind == "attempt.published"]
            assert [(ev.checkpoint_id, ev.data["final_dir"]) for ev in published] == [(cid, str(into))]
            assert load_snapshot(into).checkpoint_id == cid
            assert (into / "gym").is_dir()
            assert "attempt.completed" in kinds
            assert "attempt.aborted" not in kinds
        else:  # rolled back: what the servers wrote is gone
            assert "attempt.published" not in kinds
            assert sorted(p.name for p in into.iterdir()) == ["trainer_state.pt"]
            assert kinds[-1] == "attempt.aborted"
        assert (into / "trainer_state.pt").read_bytes() == b"the trainer's half"
        assert read_latest(cluster.snapshots) is None
        assert published_folders(cluster.snapshots) == []
        await assert_second_recover_is_a_no_op(http, cluster, ledger_url)
        await trainer.unpace()
        assert await trainer.wait_results() == expected_results(tasks)
    await assert_ledger_ok(ledger_url)


# ---------------------------------------------------------------------------------------------
# Restores
# ---------------------------------------------------------------------------------------------


async def _snapshot(v2: Any, http: httpx.AsyncClient, tasks: dict[str, Any]) -> tuple[Path, Trainer]:
    """A snapshot taken mid-episode (two turns of five run); the trainer is detached from its
    cluster, as when that cluster is gone."""
    with v2("source") as source:
        trainer = await parked_trainer(http, source, tasks)
        done = await quiesce("checkpoint", "--config", str(source.config), "--json")
        assert done.returncode == 0, done.stderr[-2000:]
        await trainer.detach()
    snapshot = read_latest(source.snapshots)
    assert snapshot is not None
    return snapshot, trainer


async def test_a_restore_killed_mid_way_is_cleaned_up_then_a_fresh_restore_finishes_exactly(
    v2: Any, ledger_url: str, http: httpx.AsyncClient, wire_oracle: Violations
) -> None:
    """Killed half-way through a restore — the agent restored, the resources server's restore
    still on its way (held 3 s by a delay fault) — it is never finished half-way: recovery retires
    the next attempt of every episode on every server and resumes everyone, and the restore that
    arrives late is refused (its id was resumed). Then the servers are started fresh and the
    snapshot restored again, and the episodes finish exactly."""
    tasks = make_tasks(3, turns=5)
    snapshot, trainer = await _snapshot(v2, http, tasks)
    restore = ("restore", "--snapshot", str(snapshot), "--json")
    with v2("half") as half:
        late = {"kind": "delay", "when": "before", "path": "/checkpoint/restore", "seconds": DELAY_S}
        reply = await http.post(half.urls["resources"] + "/gymsim/admin/faults", json={"faults": [late]})
        reply.raise_for_status()
        # the instant the agent's second reply (its discovery status, then its restore) is staged
        kill = {"kind": "call.replied", "server": "agent", "nth": 2, "when": "staged"}
        await killed(*restore, "--config", str(half.config), kill=kill)
        before = await phases(http, half)
        assert (before["agent"][0], before["resources"][0]) == ("restored", "idle"), before
        document = await recover(half)
        [found] = document["attempts"]
        assert found["action"] == "resumed"
        assert "retired everywhere" in found["message"]
        after = await state(http, half)
        assert {n: (s["phase"], s["checkpoint_id"]) for n, s in after.items()} == dict.fromkeys(
            NAMES, ("idle", None)
        )
        # the next attempt of every episode is retired on every server, nothing restored is pending
        assert {n: s["retire_marks"] for n, s in after.items()} == {n: dict.fromkeys(tasks, 1) for n in NAMES}
        assert after["environment"]["restored_pending"] == []
        await assert_no_lease_expired(http, half)
        aborted = [ev for ev in await events(ledger_url) if ev.kind == "attempt.aborted"]
        assert aborted[-1].checkpoint_id == found["checkpoint_id"]
        assert sorted(aborted[-1].data["resumed"]) == sorted(NAMES)
        await assert_second_recover_is_a_no_op(http, half, ledger_url)
        await anyio.sleep(DELAY_S + 0.5)  # the late restore has reached the resources server
        assert (await phases(http, half))["resources"] == ("idle", None)
        # the wire oracle saw that request's body cut short by the SIGKILL: the only drift there is
        assert all(p.startswith("resources: request v2 restore") for p in wire_oracle.take())
        stale = await http.post(
            half.urls["environment"] + "/run",
            json={"episode_id": {"rollout_id": "r0", "attempt": 1}, "task": tasks["r0"]},
        )
        assert (stale.status_code, stale.json()["error"]["code"]) == (409, "stale_attempt")
    with v2("fresh") as fresh:
        done = await quiesce(*restore, "--resume", "--config", str(fresh.config))
        assert done.returncode == 0, done.stderr[-2000:]
        await trainer.continue_on(fresh.urls["environment"])
        assert await trainer.wait_results() == expected_results(tasks)
    assert published_folders(snapshot.parent) == [snapshot.name]
    await assert_ledger_ok(ledger_url)


async def test_a_restore_killed_before_the_resume_its_caller_asked_for_is_finished(
    v2: Any, ledger_url: str, http: httpx.AsyncClient
) -> None:
    """`restore --resume` killed after every server restored, before the first resume left:
    the restore phase completed, so recovery finishes the resume; the next attempts continue
    from the saved boundary and finish exactly."""
    tasks = make_tasks(3, turns=5)
    snapshot, trainer = await _snapshot(v2, http, tasks)
    with v2("fresh") as fresh:
        kill = {"kind": "call.sent", "path": "/checkpoint/resume"}
        argv = ("restore", "--snapshot", str(snapshot), "--resume", "--config", str(fresh.config))
        await killed(*argv, kill=kill)
        before = await phases(http, fresh)
        assert {phase for phase, _ in before.values()} == {"restored"}
        document = await recover(fresh)
        [found] = document["attempts"]
        assert found["action"] == "resumed"
        assert [(r["rollout_id"], r["attempt_index"]) for r in found["resubmit"]] == [(r, 1) for r in tasks]
        assert await phases(http, fresh) == dict.fromkeys(NAMES, ("idle", None))
        await assert_no_lease_expired(http, fresh)
        await assert_second_recover_is_a_no_op(http, fresh, ledger_url)
        await trainer.continue_on(fresh.urls["environment"])
        assert await trainer.wait_results() == expected_results(tasks)
    await assert_ledger_ok(ledger_url)
