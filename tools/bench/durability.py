"""Measure #9 — ``durability: process`` vs ``full`` side by side, so users can choose with numbers.

The 4-server reference cluster of measure #3 with rollouts running; one run (``cycle.run_cycles``
with sides full, process and null, a fresh process per run) interleaves, in a rotating order and
after the same settle time per round, saves on a real SQLite ledger with ``durability: full``
(the default: ``attempt.started`` and the events a user is answered on are fdatasynced), on one
with ``durability: process`` (never fsynced but by SQLite's checkpoints: survives a crash of the
process, not of the machine), and on the null ledger. Reported: ms per save and what each adds
over the null ledger, wall and CPU. Not a goal: a choice.
"""

from __future__ import annotations

import secrets
from typing import Any

import anyio

from quiesce.tools.bench.cycle import SPEC, cluster, interval_text, pooled_difference, start_rollouts
from quiesce.tools.bench.harness import Context, Result, run_child, stats_of

CYCLES = 60


def measure(ctx: Context) -> Result:
    """Measure #9 (see the module docstring)."""
    result = Result(9, "save cycle, 4-server cluster: durability process vs full", "— (a choice, not a goal)")
    cycles = 2 if ctx.quick else CYCLES
    token = "bench-" + secrets.token_hex(8)
    runs: list[dict[str, Any]] = []
    for index in range(ctx.runs):
        with cluster(SPEC, token, ctx.work) as running:
            anyio.run(start_rollouts, running.urls, ["simple_agent"], 4, 1_000_000)
            folder = ctx.work / f"durability-{index}"
            folder.mkdir()
            params = {
                "config": running.config(),
                "token": token,
                "cycles": cycles,
                "dir": str(folder),
                # "lazy": durability process (a side named "process" would clash with the child's
                # own process_cpu_s)
                "sides": ["real", "lazy", "null"],
            }
            runs.append(run_child("cycle:run_cycles", params))
        last = runs[-1]
        ctx.log(
            f"  run {index + 1}/{ctx.runs}: full {last['real_s'] * 1e3:.1f} ms, process"
            f" {last['lazy_s'] * 1e3:.1f} ms, null {last['null_s'] * 1e3:.1f} ms"
        )
    rows = []
    # the published names: real_*, process_*, null_* (the child's "lazy" side is "process")
    for side, name, label in (
        ("real", "real", "durability: full"),
        ("lazy", "process", "durability: process"),
        ("null", "null", "null ledger"),
    ):
        wall, cpu = stats_of(runs, f"{side}_s"), stats_of(runs, f"{side}_cpu_s")
        result.metric(f"{name}_s", wall, "s")
        result.metric(f"{name}_cpu_s", cpu, "s")
        row = {"ledger": label, "ms per save": wall.fmt(1e3, 1), "CPU ms per save": cpu.fmt(1e3, 1)}
        if side != "null":
            added, overhead = stats_of(runs, f"{side}_added_s"), stats_of(runs, f"{side}_overhead")
            result.metric(f"{name}_added_s", added, "s")
            result.metric(f"{name}_overhead", overhead, "fraction")
            row["adds over the null ledger"] = f"{overhead.fmt(100, 1, '%')} = {added.fmt(1e3, 1, 'ms')}"
            pooled = pooled_difference(runs, side)
            result.metric(f"{name}_added_pooled_s", pooled, "s (median difference [95% bootstrap interval])")
            row["runs pooled: 95% bootstrap interval"] = interval_text(pooled)
        rows.append(row)
    full, process = stats_of(runs, "real_s"), stats_of(runs, "lazy_s")
    full_added, process_added = stats_of(runs, "real_added_s"), stats_of(runs, "lazy_added_s")
    result.metric("peak_rss_mb", stats_of(runs, "peak_rss_mb"), "MB")
    result.runs = len(runs)
    result.rows = rows
    result.value = (
        f"full {full.fmt(1e3, 1, 'ms')} per save (ledger adds {full_added.fmt(1e3, 1, 'ms')});"
        f" process {process.fmt(1e3, 1, 'ms')} (adds {process_added.fmt(1e3, 1, 'ms')})"
    )
    result.baseline = f"null ledger {stats_of(runs, 'null_s').fmt(1e3, 1, 'ms')} per save"
    result.met = None
    result.side(
        "durability: full",
        durability="full: fdatasync of the WAL before the first request and at the"
        " events a user is answered on",
        transport="loopback HTTP",
        order="rotated per round",
    )
    result.side(
        "durability: process",
        durability="process: no fsync (SQLite checkpoints only); survives a process crash, not a power loss",
        transport="the same",
        order="the same",
    )
    result.side("null ledger", durability="none", transport="the same", order="the same")
    result.notes.append(f"{cycles} saves per side per run, as measure #3")
    return result
