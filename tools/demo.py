"""`quiesce demo`: the whole story on a local reference Gym cluster, with an embedded SQLite ledger.

1. run the rollouts once on a cluster that is never interrupted (the reference results);
2. start a fresh cluster (a real subprocess), run the same rollouts, checkpoint it mid-rollout
   (the trainer's half goes into the staging folder), let it run on a little, then SIGKILL it;
3. start another fresh cluster, restore the snapshot into it, resume, then do what a trainer on
   real Gym must: send `/run` again for exactly the executions the restore lists
   (`Attempt.resubmit`: each saved rollout as its next attempt) — nothing runs them otherwise —
   and let the rollouts finish;
4. compare: every rollout must end exactly as in the uninterrupted run, no turn lost or run twice;
5. print the attempts and their calls from the ledger.

Like a trainer, the demo acknowledges every finished result it reads (`acknowledge_completed`, a
recorded control call): Gym holds a finished rollout until its consumer confirms it has it.

The control token is random, set in this process's environment and the clusters', never printed.
Exit 0 when everything matches, 1 otherwise.

The demo's folder: it deletes nothing it did not make. A new or empty folder is taken and marked
(`MARKER`); a folder with that marker is cleared of what an earlier run made (`MADE`: anything
else in it stays); any other non-empty folder is refused (`FolderRefused`) before anything runs.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from quiesce.coordinator import Coordinator, load_snapshot
from quiesce.coordinator.protocol import PREFIX, TOKEN_ENV
from quiesce.ledger import Ledger
from quiesce.tools.gymsim import client
from quiesce.tools.gymsim.cluster import spawn_cluster

#: The seed's example cluster with some latency, so a checkpoint lands mid-rollout.
DEMO_SPEC: dict[str, Any] = {
    "servers": [
        {"kind": "model", "name": "policy_model", "latency_s": 0.05},
        {"kind": "model", "name": "judge", "instance_role": "auxiliary"},
        {"kind": "agent", "name": "simple_agent", "policy": "policy_model", "resources": "tools"},
        {"kind": "agent", "name": "math_agent", "checkpoint_mode": "stateless", "policy": "policy_model"},
        {"kind": "resources", "name": "tools", "judge": "judge", "latency_s": 0.01},
    ]
}
ROLLOUTS: dict[str, int] = {f"rollout-{i}": 20 for i in range(6)}
AGENT = "simple_agent"


#: The file that marks a folder as the demo's own.
MARKER = ".quiesce-demo-folder"
#: What a run writes into its folder (besides `MARKER`): all that a later run removes.
MADE: tuple[str, ...] = (
    "ledger.db",
    "ledger.db-wal",
    "ledger.db-shm",
    "ledger.db.writer-lock",
    "snapshots",
    "cluster-reference",
    "cluster-1",
    "cluster-2",
    "cluster-1.yaml",
    "cluster-2.yaml",
)


class DemoFailed(Exception):
    pass


class FolderRefused(Exception):
    """The folder is not the demo's to use (bad usage: the CLI exits 2)."""


def prepare_folder(folder: Path) -> Path:
    """Make `folder` the demo's: create it, take it when empty, or remove what an earlier run made
    in it when it has the marker; returns its absolute path. Raises `FolderRefused`, touching
    nothing, for a non-empty folder without the marker or a path that is not a folder."""
    if folder.exists() and not folder.is_dir():
        raise FolderRefused(f"--dir {folder}: not a folder; name a new or empty folder for the demo")
    if folder.is_dir() and any(folder.iterdir()):
        if not (folder / MARKER).is_file():
            raise FolderRefused(
                f"--dir {folder} is not empty and was not made by `quiesce demo` (no {MARKER} in it);"
                " the demo deletes nothing it did not make: name a new or empty folder (a folder of"
                " an older quiesce demo carries no mark: remove it yourself)"
            )
        for name in MADE:
            path = folder / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text(
        "made by `quiesce demo`: a later run removes only what the demo wrote here\n", encoding="utf-8"
    )
    return folder.resolve()


def _say(console: Console) -> Callable[[str], None]:
    def say(text: str) -> None:
        console.print(f"[green]✓[/] {text}", soft_wrap=True)

    return say


async def _consume(coord: Coordinator, rollouts: dict[str, Any]) -> int:
    """Acknowledge every finished result read (as a trainer does once it holds them); the count."""
    finished = [
        (r["rollout_id"], int(r["attempt_index"]))
        for r in rollouts.values()
        if r["status"] == "completed" and not r.get("acknowledged")
    ]
    if finished:
        await coord.acknowledge_completed(AGENT, finished)
    return len(finished)


async def _uninterrupted(env: dict[str, str], work: Path, ledger_url: str, snapshots: Path) -> dict[str, Any]:
    with spawn_cluster(DEMO_SPEC, env=env, workdir=work / "cluster-reference") as cluster:
        config = cluster.write_config(work / "cluster-reference.yaml", ledger_url, snapshots)
        async with httpx.AsyncClient(timeout=30) as http:
            await client.start_rollouts(http, cluster.urls[AGENT], ROLLOUTS)
            rollouts = await client.wait_finished(http, cluster.urls[AGENT], timeout_s=120)
            async with Coordinator.open(config) as coord:
                await _consume(coord, rollouts)
    problems = client.turn_log_problems(rollouts)
    if problems:
        raise DemoFailed("the uninterrupted run itself is inconsistent: " + "; ".join(problems))
    return client.final_results(rollouts)


async def run_demo(
    folder: Path, console: Console, result: dict[str, Any] | None = None, *, plane: str = "v1"
) -> int:
    """Run the demo in `folder` (`prepare_folder` first: raises `FolderRefused`) on `plane` (v1, or
    Gym's unified plane: `demo_v2.py`). Returns the exit code (1 on any failure); fills `result`
    (the `--json` document) when given."""
    where = await anyio.to_thread.run_sync(prepare_folder, folder)
    found: dict[str, Any] = {} if result is None else result
    found.update({"dir": str(where), "ok": False, "error": None})
    try:
        if plane == "v2":
            from quiesce.tools.demo_v2 import run_demo_v2

            return await run_demo_v2(folder, console, found)
        return await _run(folder, console, found)
    except (DemoFailed, TimeoutError, client.RolloutError, httpx.HTTPError, RuntimeError) as error:
        found["error"] = str(error)
        console.print(f"[bold red]✗ demo failed:[/] {escape(str(error))}", soft_wrap=True)
        return 1


async def _run(folder: Path, console: Console, result: dict[str, Any]) -> int:
    say = _say(console)
    started = time.monotonic()
    token = secrets.token_urlsafe(24)
    os.environ[TOKEN_ENV] = token
    env = {TOKEN_ENV: token}
    ledger_url = f"sqlite+aiosqlite:///{(folder / 'ledger.db').resolve()}"
    snapshots = (folder / "snapshots").resolve()
    result.update({"ledger": ledger_url, "snapshots": str(snapshots), "rollouts": len(ROLLOUTS)})

    expected = await _uninterrupted(env, folder, ledger_url, snapshots)
    say(
        f"reference run: {len(ROLLOUTS)} rollouts of {next(iter(ROLLOUTS.values()))} turns, never interrupted"
    )

    async with httpx.AsyncClient(timeout=30) as http:
        with spawn_cluster(DEMO_SPEC, env=env, workdir=folder / "cluster-1") as first:
            config_1 = first.write_config(folder / "cluster-1.yaml", ledger_url, snapshots)
            say(f"started reference Gym cluster #1 (pid {first.pid}): {', '.join(first.urls)}")
            await client.start_rollouts(http, first.urls[AGENT], ROLLOUTS)
            await client.wait_turns(http, first.urls[AGENT], 3)
            async with Coordinator.open(config_1) as coord:
                found = await coord.discover()
                say(
                    f"discovered participants {', '.join(found.names)};"
                    f" skipped {', '.join(n for n, _ in found.skipped)} (auxiliary / stateless)"
                )
                async with coord.save(deadline_s=30) as attempt:
                    assert attempt.staging_dir is not None
                    trainer = attempt.staging_dir / "trainer"
                    trainer.mkdir()
                    (trainer / "state.json").write_text(json.dumps({"step": 3, "note": "the trainer's half"}))
            assert attempt.snapshot is not None
            result["checkpoint_id"] = attempt.checkpoint_id
            rollouts = await client.get_rollouts(http, first.urls[AGENT])
            turns = sorted(r["turns_done"] for r in rollouts.values())
            done = f"{turns[0]}-{turns[-1]}"
            say(f"checkpoint {attempt.checkpoint_id} published mid-rollout (turns done: {done})")
            target = turns[0] + 2
            await client.wait_until(
                http,
                first.urls[AGENT],
                lambda rs: all(
                    r["turns_done"] >= target or r["status"] in client.FINISHED for r in rs.values()
                ),
                timeout_s=60,
            )
            first.kill()
            say("killed cluster #1 (SIGKILL) — its rollouts had moved past the checkpoint")

        with spawn_cluster(DEMO_SPEC, env=env, workdir=folder / "cluster-2") as second:
            config_2 = second.write_config(folder / "cluster-2.yaml", ledger_url, snapshots)
            say(f"started a fresh cluster #2 (pid {second.pid})")
            async with Coordinator.open(config_2) as coord:
                await coord.discover()
                restored = await coord.restore("latest")
                result["restored_as"] = restored.checkpoint_id
                say(f"restored {restored.source_checkpoint_id} as {restored.checkpoint_id}; servers paused")
                await coord.resume()
                say("resumed every server")
                servers = sorted({r.server for r in restored.resubmit})
                for server in servers:
                    await client.resubmit(http, second.urls[server], restored.resubmit_on(server))
                result["resubmitted"] = [r.as_json() for r in restored.resubmit]
                say(
                    f"sent /run again for the {len(restored.resubmit)} executions the restore listed"
                    f" (each saved rollout as its next attempt) on {', '.join(servers) or 'no agent'}"
                )
                rollouts = await client.wait_finished(http, second.urls[AGENT], timeout_s=120)
                consumed = await _consume(coord, rollouts)
                say(
                    f"acknowledged the {consumed} finished results read, as a trainer does once it holds them"
                )
    results = client.final_results(rollouts)
    return await judge(
        expected,
        results,
        client.turn_log_problems(rollouts),
        Judged(attempt.snapshot, ledger_url, snapshots, folder, started, "rollouts"),
        console,
        result,
    )


@dataclass(frozen=True)
class Judged:
    """What the end of a demo run reports on: the snapshot saved mid-run, where the ledger and
    snapshots are, when the run started, and what its units are called (rollouts, episodes)."""

    snapshot: Path | None
    ledger_url: str
    snapshots: Path
    folder: Path
    started: float
    noun: str


async def judge(
    expected: dict[str, str],
    results: dict[str, str],
    problems: list[str],
    run: Judged,
    console: Console,
    result: dict[str, Any],
) -> int:
    """The end of a demo run, either plane: every result must equal the uninterrupted run's, the
    trainer's half must be in the snapshot; prints the ledger's history and the verdict, fills
    `result`; the exit code."""
    differences = [
        f"{rid}: expected {expected.get(rid)!r}, got {results.get(rid)!r}"
        for rid in sorted(set(expected) | set(results))
        if expected.get(rid) != results.get(rid)
    ]
    differences += problems
    assert run.snapshot is not None
    snapshot = load_snapshot(run.snapshot)
    if not any(f["path"] == "trainer/state.json" for f in snapshot.manifest["files"]):
        differences.append("the trainer's half is missing from the snapshot")
    await _print_history(run.ledger_url, console)
    elapsed = time.monotonic() - run.started
    result.update({"differences": differences, "elapsed_s": round(elapsed, 3), "ok": not differences})
    if differences:
        console.print(f"[bold red]✗ the restored {run.noun} differ from the uninterrupted run:[/]")
        for line in differences:
            console.print(f"  {escape(line)}", soft_wrap=True)
        return 1
    _say(console)(f"all {len(results)} {run.noun} finished exactly as the uninterrupted run ({elapsed:.1f}s)")
    console.print(
        f"ledger: {escape(run.ledger_url)}\nsnapshots: {escape(str(run.snapshots))}\n"
        f"try: quiesce history --ledger {escape(str(run.folder / 'ledger.db'))}",
        soft_wrap=True,
    )
    return 0


def _operation(path: str) -> str:
    return path.removeprefix(PREFIX).rstrip("/").rsplit("/", 1)[-1]


async def _print_history(ledger_url: str, console: Console) -> None:
    """One row per phase of each attempt: the calls in order, ✓ replied / ✗ failed, repeats counted."""
    async with Ledger.open(ledger_url, readonly=True) as ledger:
        rows = await ledger.attempts()
        table = Table(title="attempts and their calls (from the ledger)", title_justify="left")
        for column in ("checkpoint", "kind", "outcome", "phase", "calls, in order"):
            table.add_column(column, overflow="fold")
        for row in rows:
            phases: dict[str, list[tuple[str, str]]] = {}
            outcomes: dict[str, str] = {}
            ends: list[str] = []
            async for ev in ledger.read(checkpoint_id=row.checkpoint_id):
                if ev.kind == "call.sent" and ev.call_id:
                    label = f"{ev.server} {_operation(str(ev.data.get('path', '')))}"
                    phases.setdefault(str(ev.data.get("phase")), []).append((ev.call_id, label))
                elif ev.kind in ("call.replied", "call.failed") and ev.call_id:
                    outcomes[ev.call_id] = "✓" if ev.kind == "call.replied" else "✗"
                elif ev.kind in ("attempt.completed", "attempt.aborted"):
                    ends.append(str(ev.data.get("outcome", "aborted")))
            first = True
            for phase, calls in phases.items():
                shown: list[str] = []
                for call_id, label in calls:
                    text = f"{label} {outcomes.get(call_id, '?')}"
                    base = shown[-1].split(" ×")[0] if shown else None
                    if base == text:
                        count = int(shown[-1].split(" ×")[1]) + 1 if " ×" in shown[-1] else 2
                        shown[-1] = f"{text} ×{count}"
                    else:
                        shown.append(text)
                table.add_row(
                    row.checkpoint_id if first else "",
                    row.kind if first else "",
                    ", ".join(ends) or row.state if first else "",
                    phase,
                    escape(" → ".join(shown)),
                )
                first = False
    console.print(table)
