"""The backend in a Ray actor of its own (`CheckpointHost`, `max_restarts=1`) driven from the driver
(`RemoteEnvironmentCheckpoint`), and the processes that hold a backend killed for real:

- the host's process SIGKILLed mid-commit (a server's commit held for seconds), restarted by Ray:
  it recovers from the ledger before it answers — the dead attempt rolled back, every server
  resumed, nothing of it left in RL's folder — and a retried snapshot succeeds;
- a driver process holding the backend in-process SIGKILLed between commit and resume (inside
  RL's block): `quiesce recover` leaves no server paused and rolls the save back.

Real Ray, real stand-in Gym actors running gymsim v2 deployments, a real SQLite ledger.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
import ray
import yaml

from quiesce.coordinator.protocol_v2 import PREFIX
from quiesce.ledger import Ledger
from quiesce.rl.deployments import cluster_servers, find_deployments
from quiesce.rl.episodes import Episode
from quiesce.rl.host import CheckpointHost, RemoteEnvironmentCheckpoint
from quiesce.tools.audit.cli import check_ledger
from quiesce.tools.gymsim.v2.trainer import make_tasks
from tests.rl.conftest import ROOT, ShardSet, StartActors, env_handles

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


async def in_flight(shards: ShardSet) -> list[Episode]:
    out: list[Episode] = []
    for handle in shards.checkpoint_handles.values():
        out.extend(Episode.coerce(e) for e in await handle.in_flight.remote())
    return out


async def parked(shards: ShardSet) -> None:
    for prefix, handle in zip("ab", shards.checkpoint_handles.values(), strict=True):
        await handle.start_episodes.remote(make_tasks(2, turns=4, prefix=prefix), paced=True)
        await handle.advance.remote(2)
        await handle.wait_parked.remote()


async def write_config(shards: ShardSet, tmp_path: Path) -> Path:
    """The cluster config of every deployment, as the builder makes it, in a file."""
    servers = cluster_servers(await find_deployments(env_handles(shards)))
    document = {
        "ledger": f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}",
        "snapshots": str(tmp_path / "snapshots"),
        "deadline_s": 60,
        "servers": servers,
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


async def phases(shards: ShardSet, token: str) -> dict[str, str]:
    out: dict[str, str] = {}
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        for instance, handle in shards.checkpoint_handles.items():
            for name, url in (await handle.urls.remote()).items():
                reply = await http.get(f"{url}{PREFIX}/status", headers={"authorization": f"Bearer {token}"})
                out[f"{instance}/{name}"] = reply.json()["phase"]
    return out


def ledger_of(config: Path) -> str:
    url: str = yaml.safe_load(config.read_text())["ledger"]
    return url


async def events(url: str) -> list[Any]:
    async with Ledger.open(url, readonly=True) as ledger:
        return [e async for e in ledger.read()]


async def started(host: Any) -> dict[str, Any]:
    """The host's `start()`, once Ray has it back (a restarting actor is unavailable a while)."""
    for _ in range(240):
        try:
            reply: dict[str, Any] = await host.start.remote()
        except ray.exceptions.ActorUnavailableError:
            await anyio.sleep(0.25)
            continue
        return reply
    raise AssertionError("the host never came back")


@pytest.mark.usefixtures("ray_local")
async def test_a_host_killed_mid_commit_is_restarted_recovers_and_a_retry_succeeds(
    gym_actors: StartActors, tmp_path: Path, token: str
) -> None:
    shards = await gym_actors("v2")
    await parked(shards)
    config = await write_config(shards, tmp_path)
    url = ledger_of(config)
    host_class = ray.remote(max_restarts=1, max_task_retries=0)(CheckpointHost)
    # the token goes as an argument (Ray keeps it in memory to restart the actor), never through
    # runtime_env's env_vars, which Ray's runtime-env agent writes to its log in clear
    host: Any = host_class.remote(str(config), token=token)
    backend = RemoteEnvironmentCheckpoint(host, expected=lambda cut: in_flight(shards))
    assert await started(host) == {"attempts": []}
    # replica 1's agent takes 5 s over its commit: the host dies while it is under way
    agent_url = (await list(shards.checkpoint_handles.values())[1].urls.remote())["agent"]
    slow = {"kind": "delay", "path": f"{PREFIX}/commit", "seconds": 5.0, "when": "during", "times": 1}
    async with httpx.AsyncClient(trust_env=False) as http:
        assert (
            await http.post(f"{agent_url}/gymsim/admin/faults", json={"faults": [slow]})
        ).status_code == 200
    path = tmp_path / "rl" / "step_1"
    path.mkdir(parents=True)

    failures: list[BaseException] = []

    async def snapshot_then_die() -> None:
        try:
            async with backend.snapshot(path):
                raise AssertionError("the host died mid-commit: the snapshot never opens")
        except Exception as error:  # Ray's actor-died error, whichever of its kinds
            failures.append(error)

    async with anyio.create_task_group() as tg:
        tg.start_soon(snapshot_then_die)
        for _ in range(150):  # until the commit requests are out
            if any(e.kind == "call.sent" and e.data["path"].endswith("/commit") for e in await events(url)):
                break
            await anyio.sleep(0.2)
        await anyio.sleep(0.5)
        ray.kill(host, no_restart=False)  # SIGKILL; Ray restarts the actor
    assert len(failures) == 1
    assert not isinstance(failures[0], AssertionError)
    dead = [e for e in await events(url) if e.kind == "attempt.started"][-1].checkpoint_id
    # the restarted host recovers before it answers: the dead save rolled back, every server resumed
    recovered = await started(host)
    assert recovered == {"attempts": [{"checkpoint_id": dead, "action": "resumed"}]}
    assert set((await phases(shards, token)).values()) == {"idle"}
    assert not (path / "gym-instances").exists()
    # a retry succeeds
    async with backend.snapshot(path) as snap:
        await snap.check_against_cut(None)
    assert (path / "gym_checkpoint.json").is_file()
    assert {e.capture_key for e in snap.episodes} == {e.capture_key for e in await in_flight(shards)}
    await host.close.remote()
    report = await check_ledger(url)
    assert [v for v in report.violations if not v.rule.startswith("lineage")] == []
    assert leaked(token, tmp_path) == []


def leaked(token: str, *folders: Path) -> list[str]:
    """Every file under Ray's session folder and `folders` that holds `token`."""
    node: Any = ray._private.worker._global_node  # Ray has no public API for its session folder
    session = Path(node.get_session_dir_path())
    found = []
    for folder in (session, *folders):
        for file in folder.rglob("*"):
            if file.is_file() and not file.is_symlink():
                try:
                    if token.encode() in file.read_bytes():
                        found.append(str(file))
                except OSError:
                    continue
    return found


DRIVER = """
import asyncio, os, signal, sys
from quiesce.rl.backend import QuiesceEnvironmentCheckpoint

async def main(config, path):
    async with QuiesceEnvironmentCheckpoint(config) as backend:
        async with backend.snapshot(path) as snap:
            print(snap.checkpoint_id, flush=True)
            (__import__("pathlib").Path(path) / "tq.pt").write_bytes(b"RL's half")
            os.kill(os.getpid(), signal.SIGKILL)  # the driver dies inside RL's block

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.mark.usefixtures("ray_local")
async def test_a_driver_killed_between_commit_and_resume_leaves_nothing_paused_after_recover(
    gym_actors: StartActors, tmp_path: Path, token: str
) -> None:
    shards = await gym_actors("v2")
    await parked(shards)
    config = await write_config(shards, tmp_path)
    path = tmp_path / "rl" / "step_2"
    path.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    driver = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-c", DRIVER, str(config), str(path)],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )
    )  # fmt: skip
    assert driver.returncode == -9, driver.stderr[-2000:]
    cid = driver.stdout.strip()
    held = await phases(shards, token)
    assert set(held.values()) == {"committed"}, held  # paused, under the dead driver's save
    done = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-m", "quiesce", "recover", "--config", str(config), "--json"],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert [(a["checkpoint_id"], a["action"]) for a in json.loads(done.stdout)["attempts"]] == [
        (cid, "resumed")
    ]
    assert set((await phases(shards, token)).values()) == {"idle"}
    # RL never published the folder: what Gym wrote is gone, RL's own half is RL's to drop
    assert not (path / "gym-instances").exists()
    assert (path / "tq.pt").read_bytes() == b"RL's half"
    for handle in shards.checkpoint_handles.values():
        await handle.unpace.remote()
        assert len(await handle.wait_results.remote()) == 2  # the episodes run on and finish
    assert leaked(token, tmp_path) == []
