"""`quiesce demo --plane v2`: the whole story on Gym's unified checkpoint plane, on local v2
reference servers (`tools/gymsim/v2`), with an embedded SQLite ledger.

1. run the episodes once on a cluster that is never interrupted (the reference results — also
   checked against `expected_results`, the pure function of each task);
2. start a fresh cluster (a real subprocess), run the same episodes freely, checkpoint it
   mid-rollout — the scope is derived from what the environment server itself owns, the
   trainer's half goes into the staging folder — let it run on a little, then SIGKILL it;
3. start another fresh cluster, restore the snapshot into it (all or nothing), resume, then do
   what a trainer on Gym's unified plane must: start each restored episode's replacement attempt
   (`Attempt.resubmit`: attempt n+1, which continues from the saved boundary) — and let every
   episode finish;
4. compare: every episode must end exactly as in the uninterrupted run;
5. print the attempts and their calls from the ledger.

The folder rules and the exit codes are `quiesce demo`'s (`tools/demo.py`).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
from rich.console import Console

from quiesce.coordinator import Coordinator
from quiesce.coordinator.protocol import TOKEN_ENV
from quiesce.tools.demo import DemoFailed, Judged, _say, judge
from quiesce.tools.gymsim.cluster import spawn_cluster
from quiesce.tools.gymsim.v2.trainer import EpisodeFailed, Trainer, expected_results, make_tasks

#: Gym's unified plane: an environment whose turns call one agent, which calls the policy model
#: (with some latency, so the checkpoint lands mid-rollout) and one resources server.
DEMO_V2_SPEC: dict[str, Any] = {
    "servers": [
        {"kind": "environment", "plane": "v2", "name": "environment", "agent": "agent"},
        {"kind": "model", "plane": "v2", "name": "policy_model", "latency_s": 0.05},
        {
            "kind": "agent",
            "plane": "v2",
            "name": "agent",
            "policy": "policy_model",
            "resources": "resources",
        },
        {"kind": "resources", "plane": "v2", "name": "resources", "latency_s": 0.005},
    ]
}
EPISODES = 6
TURNS = 30
ENV = "environment"


async def _uninterrupted(env: dict[str, str], folder: Path, http: httpx.AsyncClient) -> dict[str, str]:
    tasks = make_tasks(EPISODES, turns=TURNS)
    with spawn_cluster(DEMO_V2_SPEC, env=env, workdir=folder / "cluster-reference") as cluster:
        trainer = Trainer(cluster.urls[ENV], http=http)
        await trainer.start(tasks, paced=False)
        results = await trainer.wait_results()
    if results != expected_results(tasks):
        raise DemoFailed("the uninterrupted run itself differs from the tasks' reference results")
    return results


async def _turns(trainer: Trainer) -> list[int]:
    return sorted(int(e["turn"]) for e in (await trainer.episodes()).values())


async def _until_turn(trainer: Trainer, turn: int) -> None:
    """Poll the environment until every live episode reached `turn` (or none is live)."""
    with anyio.fail_after(60):
        while (turns := await _turns(trainer)) and min(turns) < turn:  # noqa: ASYNC110 - polls a server
            await anyio.sleep(0.02)


async def run_demo_v2(folder: Path, console: Console, result: dict[str, Any]) -> int:
    """Run the v2 demo in a prepared folder (`demo.prepare_folder`); the exit code; fills `result`."""
    say = _say(console)
    started = time.monotonic()
    token = secrets.token_urlsafe(24)
    os.environ[TOKEN_ENV] = token
    env = {TOKEN_ENV: token}
    ledger_url = f"sqlite+aiosqlite:///{(folder / 'ledger.db').resolve()}"
    snapshots = (folder / "snapshots").resolve()
    tasks = make_tasks(EPISODES, turns=TURNS)
    result.update({"plane": "v2", "ledger": ledger_url, "snapshots": str(snapshots), "rollouts": EPISODES})
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(30.0, read=None)) as http:
        expected = await _uninterrupted(env, folder, http)
        say(f"reference run: {EPISODES} episodes of {TURNS} turns, never interrupted")

        trainer = Trainer("http://unused", http=http)
        with spawn_cluster(DEMO_V2_SPEC, env=env, workdir=folder / "cluster-1") as first:
            config_1 = first.write_config(folder / "cluster-1.yaml", ledger_url, snapshots)
            servers = ", ".join(first.urls)
            say(f"started reference Gym cluster #1 on the unified plane (pid {first.pid}): {servers}")
            trainer.env_url = first.urls[ENV]
            await trainer.start(tasks, paced=False)
            await _until_turn(trainer, 3)
            async with Coordinator.open(config_1) as coord:
                found = await coord.discover()
                say(f"discovered {', '.join(f'{m.name} ({m.component})' for m in found.participants)}")
                async with coord.save(deadline_s=30) as attempt:
                    assert attempt.staging_dir is not None
                    half = attempt.staging_dir / "trainer"
                    half.mkdir()
                    (half / "state.json").write_text(json.dumps({"note": "the trainer's half"}))
            assert attempt.snapshot is not None
            result["checkpoint_id"] = attempt.checkpoint_id
            say(
                f"checkpoint {attempt.checkpoint_id} published mid-rollout: {len(attempt.scope)} episodes"
                " in its scope (read from the environment server's own export)"
            )
            await _until_turn(trainer, min(await _turns(trainer), default=TURNS) + 2)
            first.kill()
            await trainer.detach()
            say("killed cluster #1 (SIGKILL) — its episodes had moved past the checkpoint")

        with spawn_cluster(DEMO_V2_SPEC, env=env, workdir=folder / "cluster-2") as second:
            config_2 = second.write_config(folder / "cluster-2.yaml", ledger_url, snapshots)
            say(f"started a fresh cluster #2 (pid {second.pid})")
            async with Coordinator.open(config_2) as coord:
                restored = await coord.restore("latest", resume=True)
            result["restored_as"] = restored.checkpoint_id
            say(
                f"restored {restored.source_checkpoint_id} as {restored.checkpoint_id} (all or nothing)"
                " and resumed every server"
            )
            chosen = [r.rollout_id for r in restored.resubmit]
            await trainer.continue_on(second.urls[ENV], chosen)
            result["resubmitted"] = [r.as_json() for r in restored.resubmit]
            say(f"started the {len(chosen)} replacement attempts the restore listed (each as attempt n+1)")
            try:
                results = await trainer.wait_results()
            except EpisodeFailed as error:
                raise DemoFailed(str(error)) from None
    return await judge(
        expected,
        results,
        [],
        Judged(attempt.snapshot, ledger_url, snapshots, folder, started, "episodes"),
        console,
        result,
    )
