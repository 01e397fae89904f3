"""Measure #8 — ``quiesce checkpoint`` from a cold process on a fresh ledger vs a 1,000,000-event ledger.

Each run: a fresh 4-server reference cluster (measure #3's, rollouts running) and, in a rotating
order, ``quiesce checkpoint --config C --json`` run as a user runs it — a new Python process,
timed from spawn to exit: start-up and imports, ledger open (schema check, head, recovery's look
for unfinished attempts), discovery, the save — once with a new, empty ledger (created at the schema
head beforehand, untimed: growth is compared, not the one-time creation) and once with a private
copy of ``quiesce.tools.bench.history``'s 1M-event ledger of recorded real cycles (one copy, reused by
every run: each adds one save). From each ledger's own timestamps the command is split
into: until the ledger is open (``coordinator.started``), discovery (to ``discovery.completed``),
the save (to the attempt's ``attempt.completed``) and the exit. Goal: 1M / fresh <= 1.2.

A third side, not judged, runs the same command on the same history with its files dropped from
the page cache first (``pagecache.evict``): what a user sees when the ledger was not read lately.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio

from quiesce.coordinator.protocol import TOKEN_ENV
from quiesce.ledger import Event, Ledger, upgrade_schema
from quiesce.tools.bench.cycle import SPEC, cluster, start_rollouts
from quiesce.tools.bench.harness import Context, Result, Stats, run_cli, stats_of
from quiesce.tools.bench.history import copy_ledger, history
from quiesce.tools.bench.pagecache import evict, ledger_files
from quiesce.tools.gymsim.cluster import write_yaml_atomic

HISTORY_EVENTS = 1_000_000
QUICK_HISTORY_EVENTS = 5_000


def _ts(at: str) -> float:
    return datetime.strptime(at, "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()


async def _tail(url: str, after: int) -> list[Event]:
    async with Ledger.open(url, readonly=True) as ledger:
        return [event async for event in ledger.read(after=after)]


async def _head(url: str) -> int:
    async with Ledger.open(url, readonly=True) as ledger:
        head = await ledger.head()
    return head.seq if head is not None else 0


def _checkpoint(config: Path, token: str, ledger: Path, *, cold: bool = False) -> dict[str, Any]:
    url = f"sqlite+aiosqlite:///{ledger}"
    before = anyio.run(_head, url) if ledger.exists() else 0
    left = evict(ledger_files(ledger)) if cold else None
    spawned_wall = time.time()
    done = run_cli(["checkpoint", "--config", str(config), "--json"], env={TOKEN_ENV: token})
    wall = done["wall_s"]
    ended_wall = spawned_wall + wall
    json.loads(done["stdout"])
    events = anyio.run(_tail, url, before)
    opened = next(e for e in events if e.kind == "coordinator.started")
    discovered = next(e for e in events if e.kind == "discovery.completed")
    completed = [e for e in events if e.kind == "attempt.completed"][-1]
    return {
        "history_events": before,
        "wall_s": wall,
        "open_s": _ts(opened.at) - spawned_wall,
        "discovery_s": _ts(discovered.at) - _ts(opened.at),
        "save_s": _ts(completed.at) - _ts(discovered.at),
        "exit_s": ended_wall - _ts(completed.at),
        "resident_before": left,
    }


def measure(ctx: Context) -> Result:
    """Measure #8 (see the module docstring)."""
    events = QUICK_HISTORY_EVENTS if ctx.quick else HISTORY_EVENTS
    result = Result(
        8,
        f"`quiesce checkpoint` from a cold process: fresh vs {events:,}-event ledger",
        "with the history <= 1.2x the fresh ledger",
    )
    source = history(ctx, events)
    big = copy_ledger(source, ctx.work / "growth-history")
    token = "bench-" + secrets.token_hex(8)
    # "history-cold": the same history ledger, dropped from the page cache right before the command
    sides = ["fresh", "history", "history-cold"]
    table: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    ratios: list[float] = []
    for index in range(ctx.runs):
        with cluster(SPEC, token, ctx.work) as running:
            anyio.run(start_rollouts, running.urls, ["simple_agent"], 4, 1_000_000)
            run: dict[str, dict[str, Any]] = {}
            for side in sides[index % 3 :] + sides[: index % 3]:
                folder = ctx.work / f"growth-{side}-{index}"
                folder.mkdir()
                ledger = big if side.startswith("history") else folder / "ledger.db"
                if (
                    side == "fresh"
                ):  # created at the schema head beforehand: growth, not creation, is compared
                    anyio.run(upgrade_schema, f"sqlite+aiosqlite:///{ledger}")
                document = running.config(f"sqlite+aiosqlite:///{ledger}", folder / "snapshots")
                config = write_yaml_atomic(folder / "cluster.yaml", document)
                run[side] = _checkpoint(config, token, ledger, cold=side == "history-cold")
                table[side].append(run[side])
        ratios.append(run["history"]["wall_s"] / run["fresh"]["wall_s"])
        ctx.log(
            f"  run {index + 1}/{ctx.runs}: fresh {run['fresh']['wall_s']:.2f} s,"
            f" history {run['history']['wall_s']:.2f} s ({ratios[-1]:.2f}x),"
            f" history from a cold page cache {run['history-cold']['wall_s']:.2f} s"
        )
    ratio = Stats.of(ratios)
    for side, runs in table.items():
        result.rows.append(
            {
                "ledger": f"{side} ({Stats.of([r['history_events'] for r in runs]).fmt(1, 0)} events before)",
                "quiesce checkpoint (s)": Stats.of([r["wall_s"] for r in runs]).fmt(1, 3),
                "start-up + ledger open (s)": Stats.of([r["open_s"] for r in runs]).fmt(1, 3),
                "discovery (s)": Stats.of([r["discovery_s"] for r in runs]).fmt(1, 3),
                "save (s)": Stats.of([r["save_s"] for r in runs]).fmt(1, 3),
                "exit (s)": Stats.of([r["exit_s"] for r in runs]).fmt(1, 3),
            }
        )
        for key in ("wall_s", "open_s", "discovery_s", "save_s", "exit_s"):
            result.metric(f"{side.replace('-', '_')}_{key}", Stats.of([r[key] for r in runs]), "s")
    result.metric("ratio", ratio, "x")
    result.runs = len(ratios)
    fresh = Stats.of([r["wall_s"] for r in table["fresh"]])
    grown = Stats.of([r["wall_s"] for r in table["history"]])
    result.value = f"{grown.fmt(1, 2, 's')} with the history = {ratio.fmt(1, 2)}x the fresh ledger"
    cold = Stats.of([r["wall_s"] for r in table["history-cold"]])
    result.metric("cold_resident_before", stats_of(table["history-cold"], "resident_before"), "")
    result.baseline = (
        f"fresh ledger: {fresh.fmt(1, 2, 's')}; the history from a cold page cache: {cold.fmt(1, 2, 's')}"
        f" = {cold.median / fresh.median:.2f}x the fresh ledger (not judged)"
    )
    result.met = ratio.median <= 1.2
    result.side(
        "fresh ledger",
        durability="full",
        transport="loopback HTTP",
        order="the three sides in a rotating order, the first side changing per run",
        ledger="new, empty",
    )
    result.side(
        "1M-event ledger",
        durability="full",
        transport="the same",
        order="the same",
        ledger=f"a copy of {source.name} (recorded real cycles), {os.path.getsize(source) / 1e6:.0f} MB",
    )
    result.side(
        "1M-event ledger, cold",
        durability="full",
        transport="the same",
        order="the same",
        ledger="the same copy, its files dropped from the page cache right before the command",
    )
    result.notes.append(
        "the command's wall time, from spawn to exit, as a user sees it; the split comes from the ledger's"
        " own timestamps (start-up + open = spawn to coordinator.started)"
    )
    result.notes.append(
        "cold: the history's files fdatasynced and dropped from the page cache with"
        " posix_fadvise(POSIX_FADV_DONTNEED) right before the command (tools/bench/pagecache.py; mincore(2)"
        f" then found {stats_of(table['history-cold'], 'resident_before').fmt(1, 3)} of their pages cached);"
        " the interpreter and quiesce's code stay cached; judged warm, as before"
    )
    return result
