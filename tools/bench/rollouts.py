"""Measure #13 — one rollout's lineage from a cold process, and the lineage fold's throughput, on a
1,000,000-event ledger of recorded real cycles whose lineage spans 100,000 rollouts (issue #38).

The ledger is ``quiesce.tools.bench.history``'s, built from the 4-server corpus (real saves with
rollouts running, a rolled-back save, a crash and its recovery, a restore and its resume) with
``rollouts=100_000``: each save's rollouts take the next ids of a rotation through 100,000 rollout
ids, so the ledger names that many distinct rollouts; cached under ``bench-results/.cache``.

Each run, in a rotating order:

- ``quiesce rollouts --ledger L --rollout ID --json`` as a user runs it (``harness.run_cli``: a new
  interpreter, spawn to exit — measure #12's way of timing ``history --limit 20``), for a rollout
  id chosen across the rotation (a different one per run), and the **process start** it pays
  before knowing its command: a new interpreter that imports ``quiesce.tools.cli.main`` and exits.
  Judged: the command minus the process start, median, <= 50 ms.
- the **lineage fold** over the whole ledger in a fresh process (``read_lineage(steps=False)``:
  what ``quiesce check`` folds, every lineage event read through the kind index), and **replay**
  (measure #5's ``run_replay``: the chain, the attempts projection and ``rollout_refs`` rebuilt and
  compared) of the same ledger, the baseline. Judged: the fold's events/s (the ledger's events over
  its time) >= 200,000 and its peak RSS <= 200 MB (check's budget); the ratio to replay beside.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from quiesce.ledger import Ledger
from quiesce.tools.bench.harness import (
    REPO_ROOT,
    Context,
    Result,
    Stats,
    child_env,
    run_child,
    run_cli,
    stats_of,
)
from quiesce.tools.bench.history import history

EVENTS = 1_000_000
ROLLOUTS = 100_000
QUICK_EVENTS = 5_000
QUICK_ROLLOUTS = 500
#: The cluster size of the corpus (measure #12's 4-server shape: many saves per event).
SIZES = [4]


async def _facts(url: str) -> dict[str, Any]:
    """Events, and a spread of rollout ids the ledger names (from its first, middle and last saves)."""
    from quiesce.ledger.rollout_refs import REF_KINDS

    async with Ledger.open(url, readonly=True) as ledger:
        head = await ledger.head()
        events = head.seq if head is not None else 0
        ids: list[str] = []
        for after in (0, events // 3, events // 2, 2 * events // 3, max(0, events - 5000)):
            async for event in ledger.read(after=after, kinds=sorted(REF_KINDS)):
                from quiesce.ledger.rollout_refs import rollout_ids

                names = rollout_ids(event.kind, event.data)
                if names:
                    ids.append(names[0])
                    break
    return {"events": events, "ids": ids}


def facts(path: str) -> dict[str, Any]:
    return anyio.run(_facts, f"sqlite+aiosqlite:///{path}")


async def _fold(path: str) -> dict[str, Any]:
    from quiesce.ledger.lineage import read_lineage

    start = time.perf_counter()
    cpu = time.process_time()
    async with Ledger.open(f"sqlite+aiosqlite:///{path}", readonly=True) as ledger:
        report = await read_lineage(ledger, steps=False)
        head = await ledger.head()
    seconds = time.perf_counter() - start
    events = head.seq if head is not None else 0
    return {
        "events": events,
        "seconds": seconds,
        "events_per_s": events / seconds,
        "cpu_s": time.process_time() - cpu,
        "rollouts": len(report.rollouts),
        "counts": report.counts(),
        "violations": len(report.violations),
    }


def run_fold(path: str) -> dict[str, Any]:
    """The lineage fold of the whole ledger at ``path`` (what ``quiesce check`` folds), timed."""
    return anyio.run(_fold, path)


def process_start() -> float:
    """Spawn to exit of a new interpreter that imports the CLI's entry point (``quiesce.tools.cli.main``)
    and exits: what every ``quiesce`` command pays before it knows its command."""
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import quiesce.tools.cli.main"],
        cwd=str(REPO_ROOT), env=child_env(), check=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return time.perf_counter() - started


def measure(ctx: Context) -> Result:
    """Measure #13 (see the module docstring)."""
    n, size = (QUICK_EVENTS, QUICK_ROLLOUTS) if ctx.quick else (EVENTS, ROLLOUTS)
    result = Result(
        13,
        f"one rollout's lineage and the lineage fold, {n:,}-event ledger of {size:,} rollouts",
        "`quiesce rollouts --rollout ID` <= 50 ms beyond the process start (cold process); the lineage"
        " fold >= 200,000 events/s with peak RSS <= 200 MB",
    )
    path: Path = history(ctx, n, SIZES, rollouts=size)
    known = run_child("rollouts:facts", {"path": str(path)})
    ids: list[str] = known["ids"]
    if not ids:
        raise RuntimeError(f"the ledger {path} names no rollout")
    cli: list[dict[str, Any]] = []
    folds: list[dict[str, Any]] = []
    replays: list[dict[str, Any]] = []
    for index in range(ctx.runs):
        rollout = ids[index % len(ids)]
        sides = ["cli", "fold", "replay"]
        for side in sides[index % 3 :] + sides[: index % 3]:
            if side == "cli":
                begun = process_start()
                done = run_cli(["rollouts", "--ledger", str(path), "--rollout", rollout, "--json"])
                took = done["wall_s"]
                cli.append({"rollout": rollout, "wall_s": took, "start_s": begun, "beyond_s": took - begun,
                            "peak_rss_mb": done["peak_rss_mb"]})  # fmt: skip
            elif side == "fold":
                folds.append(run_child("rollouts:run_fold", {"path": str(path)}, timeout_s=1800))
            else:
                replays.append(
                    run_child("replay:run_replay", {"path": str(path)}, timeout_s=1800, tree_rss=True)
                )
        ctx.log(
            f"  run {index + 1}/{ctx.runs}: rollouts --rollout {rollout} {cli[-1]['wall_s'] * 1e3:.0f} ms"
            f" (process start {cli[-1]['start_s'] * 1e3:.0f} ms),"
            f" fold {folds[-1]['events_per_s']:,.0f} events/s"
            f" ({folds[-1]['peak_rss_mb']:.0f} MB), replay {replays[-1]['events_per_s']:,.0f} events/s"
        )
    if not all(r["ok"] for r in replays):
        raise RuntimeError(f"replay did not verify the ledger: {replays}")
    beyond, wall, start = stats_of(cli, "beyond_s"), stats_of(cli, "wall_s"), stats_of(cli, "start_s")
    rate, rss = stats_of(folds, "events_per_s"), stats_of(folds, "peak_rss_mb")
    replay_rate = stats_of(replays, "events_per_s")
    ratio = Stats.of([f["events_per_s"] / r["events_per_s"] for f, r in zip(folds, replays, strict=True)])
    result.runs = ctx.runs
    result.metric("rollout_beyond_start_s", beyond, "s")
    result.metric("rollout_wall_s", wall, "s")
    result.metric("process_start_s", start, "s")
    result.metric("rollout_peak_rss_mb", stats_of(cli, "peak_rss_mb"), "MB")
    result.metric("fold_events_per_s", rate, "events/s")
    result.metric("fold_cpu_s", stats_of(folds, "cpu_s"), "s")
    result.metric("peak_rss_mb", rss, "MB")
    result.metric("replay_events_per_s", replay_rate, "events/s")
    result.metric("replay_peak_rss_mb", stats_of(replays, "tree_peak_rss_mb"), "MB")
    result.metric("fold_replay_ratio", ratio, "x")
    rollouts = folds[0]["rollouts"]
    result.value = (
        f"`rollouts --rollout ID` {beyond.fmt(1e3, 1, 'ms')} beyond the process start"
        f" ({wall.fmt(1e3, 0, 'ms')} in all); lineage fold {rate.fmt(1, 0, 'events/s')}"
        f" = {ratio.fmt(1, 2)}x replay, peak RSS {rss.fmt(1, 0, 'MB')}"
    )
    result.baseline = (
        f"process start (interpreter + the CLI's entry point) {start.fmt(1e3, 0, 'ms')}; replay of the same"
        f" ledger {replay_rate.fmt(1, 0, 'events/s')} (summed peak RSS"
        f" {stats_of(replays, 'tree_peak_rss_mb').fmt(1, 0, 'MB')})"
    )
    result.met = beyond.median <= 0.050 and rate.median >= 200_000 and rss.median <= 200
    result.rows.append({"side": "quiesce rollouts --rollout ID --json (s)", "figure": wall.fmt(1, 3)})
    result.rows.append({"side": "process start (s)", "figure": start.fmt(1, 3)})
    result.rows.append({"side": "beyond the process start (ms)", "figure": beyond.fmt(1e3, 1)})
    result.rows.append({"side": "lineage fold (events/s)", "figure": rate.fmt(1, 0)})
    result.rows.append({"side": "replay (events/s)", "figure": replay_rate.fmt(1, 0)})
    result.side("rollouts --rollout ID", durability="read only", transport="none",
                order="the three sides in a rotating order, the first side changing per run",
                processes="a new interpreter per command (clichild), and one importing the CLI's entry point"
                " just before it (the process start)")  # fmt: skip
    result.side("lineage fold", durability="read only", transport="none", order="the same",
                processes="a fresh one: read_lineage(steps=False) over every lineage event")  # fmt: skip
    result.side("replay", durability="read only", transport="none", order="the same",
                processes="measure #5's replay of the same ledger (its worker processes summed)")  # fmt: skip
    result.notes.append(
        f"ledger: {known['events']:,} events of recorded real cycles (tools/bench/history.py, the 4-server"
        f" corpus), its lineage rotating through {size:,} rollout ids; the fold saw {rollouts:,} rollouts"
        f" ({folds[0]['counts']}); file {path.stat().st_size / 1e6:.0f} MB, cached in {ctx.cache}"
    )
    result.notes.append(
        "rollouts --rollout ID reads the rollout's rows of the rollout_refs projection (revision 0006) and"
        " only the events its lineage depends on (ledger/rollout_refs.py); one rollout id per run, spread"
        f" over the history: {', '.join(ids)}"
    )
    return result
