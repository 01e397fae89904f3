"""Measure #12 — how the ledger's costs grow with its history: 0, 10k, 100k and 1M events.

Two shapes of history, each built by ``history.build_history`` from recorded real cycles: *mixed*
(clusters of 4, 16 and 64 servers — few attempts per event: 1M events are about 7,800 attempts)
and *4-server* (4-server cycles only — many small attempts: about 4× as many per event). Size 0 is
a new ledger created at the schema head. Each (shape, size) has a private copy of its ledger,
reused by every run (each run adds one save through the CLI and the saves of the save-cost part).

Each run takes each shape on a fresh 4-server reference cluster (measure #3's, rollouts running),
its sizes interleaved, ascending in even runs and descending in odd ones (so over an even number of
runs every size is as often early as late: a drift of the machine within a run spreads over all of
them). Per (shape, size):

- **Cold-process latency** of the commands a user runs (``harness.run_cli``: a new interpreter,
  timed from spawn to exit): ``quiesce checkpoint`` (first: a size-0 ledger then has an attempt
  for ``show latest``), ``history``, ``history --limit 20``, ``status``, ``show latest`` and
  ``recover`` (nothing left to recover: its cost is the ledger's look for unfinished attempts).
- **Save cost**: ``cycle.run_cycles`` in one child per shape and run: a coordinator on each
  size's copy and one on a null ledger, all in that process on that run's cluster, ``CYCLES``
  saves each after a warm-up, every round running them in the next of their rotating orders (so
  what moves a process or a cluster — seen: ±15% between two runs of one size — moves every size
  alike). The ledger's CPU per save is counted where it runs (``ledgercpu.LedgerCpu``: the thread
  CPU of the ledger's own code, on the event loop and on worker threads) — judged; the difference
  of a size's and the null side's median CPU per save (``real − null``, which also holds what the
  ledger leaves to other code, but spans ±30% over hundreds of saves) is shown beside it.

Goals (the issue's): from 0 to 1M events, ``history --limit 20`` and ``status`` within 1.2× and
the save's ledger CPU within 1.1×, on both shapes (judged on the worse). ``history`` without
``--limit`` reads every attempt: it is shown, not judged.
"""

from __future__ import annotations

import os
import random
import secrets
import statistics
from pathlib import Path
from typing import Any

import anyio

from quiesce.coordinator.protocol import TOKEN_ENV
from quiesce.ledger import Ledger, upgrade_schema
from quiesce.tools.bench.cycle import SPEC, cluster, start_rollouts
from quiesce.tools.bench.harness import Context, Result, Stats, run_child, run_cli
from quiesce.tools.bench.history import copy_ledger, history
from quiesce.tools.gymsim.cluster import write_yaml_atomic

SIZES = (0, 10_000, 100_000, 1_000_000)
QUICK_SIZES = (0, 2_000)
#: The two shapes of history: name -> the cluster sizes its corpus records.
SHAPES: dict[str, list[int]] = {"mixed": [4, 16, 64], "4-server": [4]}
CYCLES = 60
#: A save's ledger CPU below this (a few saves of a --quick run can give a difference <= 0) divides
#: as this: the ratio stays a number, and one that says nothing.
FLOOR_S = 1e-6
QUICK_CYCLES = 2
#: The commands timed from a cold process, in this order (label -> arguments after the config).
COMMANDS: dict[str, list[str]] = {
    "checkpoint": ["checkpoint"],
    "history": ["history"],
    "history --limit 20": ["history", "--limit", "20"],
    "status": ["status"],
    "show latest": ["show", "latest"],
    "recover": ["recover"],
}
#: What the goals hold flat from the smallest to the largest size, and how flat.
JUDGED = {"history --limit 20": 1.2, "status": 1.2, "save": 1.1}


async def _counts(url: str) -> tuple[int, int]:
    """(events, attempts) of the ledger at ``url``."""
    async with Ledger.open(url, readonly=True) as ledger:
        head = await ledger.head()
        attempts = len(await ledger.attempts())
    return (head.seq if head is not None else 0), attempts


def _ledger(ctx: Context, shape: str, size: int) -> Path:
    """This measure's private copy of the (shape, size) ledger (a new one at the head for 0)."""
    folder = ctx.work / f"curve-{shape}-{size}"
    if size == 0:
        folder.mkdir()
        path = folder / "ledger.db"
        anyio.run(upgrade_schema, f"sqlite+aiosqlite:///{path}")
        return path
    return copy_ledger(history(ctx, size, SHAPES[shape]), folder)


def _commands(running: Any, token: str, path: Path, tag: str) -> dict[str, Any]:
    """One (shape, size) of one run: its counts and the commands' cold-process wall times."""
    url = f"sqlite+aiosqlite:///{path}"
    folder = path.parent / tag
    folder.mkdir()
    config = write_yaml_atomic(folder / "cluster.yaml", running.config(url, folder / "snapshots"))
    events, attempts = anyio.run(_counts, url)
    out: dict[str, Any] = {"events": events, "attempts": attempts, "wall_s": {}}
    for label, args in COMMANDS.items():
        done = run_cli([*args, "--config", str(config), "--json"], env={TOKEN_ENV: token})
        out["wall_s"][label] = done["wall_s"]
    return out


def _saves(
    running: Any, token: str, paths: dict[int, Path], folder: Path, cycles: int
) -> dict[int, dict[str, Any]]:
    """The save cost of every size of one shape in one run: one child, one coordinator per size's
    ledger and a null one, all on this cluster, in rotating order round after round."""
    folder.mkdir()
    ledgers = {f"size-{size}": f"sqlite+aiosqlite:///{path}" for size, path in paths.items()}
    params = {"config": running.config(), "token": token, "cycles": cycles, "dir": str(folder),
              "ledgers": ledgers, "sides": [*ledgers, "null"], "meter": True}  # fmt: skip
    cycled = run_child("cycle:run_cycles", params)
    out: dict[int, dict[str, Any]] = {}
    for size in paths:
        side = f"size-{size}"
        samples = cycled["samples"][side]
        out[size] = {
            "save_ledger_cpu_s": cycled[f"{side}_ledger_cpu_s"],
            "save_added_cpu_s": cycled[f"{side}_added_cpu_s"],
            "save_wall_s": cycled[f"{side}_s"],
            "save_cpu_samples": {
                "real": samples["cpu_s"],
                "null": cycled["samples"]["null"]["cpu_s"],
                "ledger": samples["ledger_cpu_s"],
            },
        }
    return out


def _pooled(runs: list[dict[str, Any]], side: str) -> list[float]:
    """Every run's per-save CPU samples of ``side`` (real, null, or the ledger's own), pooled."""
    return [x for r in runs for x in r["save_cpu_samples"][side]]


def _added_cpu(runs: list[dict[str, Any]]) -> float:
    """``real − null``: median CPU per save with the real ledger minus with the null one, runs pooled."""
    return float(statistics.median(_pooled(runs, "real")) - statistics.median(_pooled(runs, "null")))


def save_ratio(
    low: list[dict[str, Any]], high: list[dict[str, Any]], *, resamples: int = 2000, seed: int = 5
) -> tuple[float, float, float]:
    """The median of the ledger's own CPU per save (``LedgerCpu``) at the largest size over that at
    the smallest, every run's saves pooled per size, and the 95% interval of that ratio by a
    two-level bootstrap (a fixed seed): the runs are resampled, then each chosen run's saves.
    A run's saves are not independent of each other — a fresh cluster and process per run moves all
    of them together (seen: 5.8 against 6.4 ms in two runs of one size) — so resampling the pooled
    saves alone would give an interval narrower than what another pair of runs would show. The
    i-th run of ``low`` and of ``high`` shared a process and a cluster, so a resample draws runs
    as pairs: the same run indices for both sizes."""
    rng = random.Random(seed)

    def ledger_samples(runs: list[dict[str, Any]]) -> list[list[float]]:
        return [list(r["save_cpu_samples"]["ledger"]) for r in runs]

    top, bottom = ledger_samples(high), ledger_samples(low)
    if len(top) != len(bottom):
        raise ValueError(f"{len(bottom)} runs at the smallest size, {len(top)} at the largest: not paired")

    def ratio(a: list[float], b: list[float]) -> float:
        return float(statistics.median(a)) / max(float(statistics.median(b)), FLOOR_S)

    def resample(runs: list[list[float]], picks: list[int]) -> list[float]:
        return [x for i in picks for x in rng.choices(runs[i], k=len(runs[i]))]

    ratios: list[float] = []
    for _ in range(resamples):
        picks = rng.choices(range(len(top)), k=len(top))
        ratios.append(ratio(resample(top, picks), resample(bottom, picks)))
    ratios.sort()
    value = ratio([x for run in top for x in run], [x for run in bottom for x in run])
    low_end, high_end = ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples)]
    return value, min(low_end, value), max(high_end, value)


def _flat(
    runs: dict[tuple[str, int], list[dict[str, Any]]], shape: str, key: str, sizes: tuple[int, ...]
) -> Stats:
    """Per run, a command's (``key``) cold-process time at the largest size over the smallest's."""
    low, high = runs[(shape, sizes[0])], runs[(shape, sizes[-1])]
    return Stats.of([b["wall_s"][key] / a["wall_s"][key] for a, b in zip(low, high, strict=True)])


def measure(ctx: Context) -> Result:
    """Measure #12 (see the module docstring)."""
    sizes = QUICK_SIZES if ctx.quick else SIZES
    shapes = ["mixed"] if ctx.quick else list(SHAPES)  # --quick records one 4-server corpus only
    cycles = QUICK_CYCLES if ctx.quick else CYCLES
    result = Result(
        12,
        f"cost growth with the history: {', '.join(f'{n:,}' for n in sizes)} events",
        "history --limit 20 and status within 1.2x, the save's ledger CPU within 1.1x,"
        f" from {sizes[0]:,} to {sizes[-1]:,} events",
    )
    token = "bench-" + secrets.token_hex(8)
    cases = [(shape, size) for size in sizes for shape in shapes]
    ledgers = {case: _ledger(ctx, *case) for case in cases}
    table: dict[tuple[str, int], list[dict[str, Any]]] = {case: [] for case in cases}
    # the copies just written (about 1 GB) are flushed before anything is timed: their write-back
    # would otherwise slow whatever runs first
    os.sync()
    for index in range(ctx.runs):
        # sizes ascending in even runs, descending in odd ones (each rotated by a further size every
        # two runs): over an even number of runs every size is as often early as late in a run; the
        # shapes alternate which goes first
        ordered = list(sizes) if index % 2 == 0 else list(sizes)[::-1]
        shift = (index // 2) % len(sizes)
        for shape in shapes if index % 2 == 0 else shapes[::-1]:
            # a fresh cluster per shape and run: the null ledger's checkpoint ids start over in every
            # save-cost child, and a server that saw an id refuses it the second time
            with cluster(SPEC, token, ctx.work) as running:
                anyio.run(start_rollouts, running.urls, ["simple_agent"], 4, 1_000_000)
                timed: dict[int, dict[str, Any]] = {}
                for size in ordered[shift:] + ordered[:shift]:
                    timed[size] = _commands(running, token, ledgers[(shape, size)], f"run-{index}")
                paths = {size: ledgers[(shape, size)] for size in ordered[shift:] + ordered[:shift]}
                folder = ctx.work / f"curve-{shape}-saves-{index}"
                for size, saved in _saves(running, token, paths, folder, cycles).items():
                    run = {**timed[size], **saved}
                    table[(shape, size)].append(run)
                    ctx.log(
                        f"  run {index + 1}/{ctx.runs} ({shape}, {size:,}): {run['attempts']:,} attempts,"
                        f" history --limit 20 {run['wall_s']['history --limit 20']:.2f} s,"
                        f" status {run['wall_s']['status']:.2f} s,"
                        f" save's ledger CPU {run['save_ledger_cpu_s'] * 1e3:.2f} ms"
                    )
    for (shape, size), runs in table.items():
        row: dict[str, Any] = {
            "history": shape,
            "events before": f"{size:,}",
            "attempts": Stats.of([r["attempts"] for r in runs]).fmt(1, 0),
        }
        for label in COMMANDS:
            row[f"{label} (s)"] = Stats.of([r["wall_s"][label] for r in runs]).fmt(1, 2)
        row["save: ledger CPU (ms), runs pooled"] = f"{statistics.median(_pooled(runs, 'ledger')) * 1e3:.2f}"
        row["save: ledger CPU (ms), per run"] = Stats.of([r["save_ledger_cpu_s"] for r in runs]).fmt(1e3, 2)
        row["save: real − null CPU (ms), runs pooled"] = f"{_added_cpu(runs) * 1e3:.2f}"
        row["save (ms)"] = Stats.of([r["save_wall_s"] for r in runs]).fmt(1e3, 1)
        result.rows.append(row)
    verdicts: list[bool] = []
    texts: list[str] = []
    for shape in shapes:
        for key, limit in JUDGED.items():
            name = key.replace(" ", "_").replace("--", "").replace("__", "_")
            if key == "save":
                value, low, high = save_ratio(table[(shape, sizes[0])], table[(shape, sizes[-1])])
                ratio = Stats(value, low, high, ctx.runs)  # min/max: the 95% bootstrap interval
                text = f"{value:.2f} [{low:.2f}–{high:.2f}, 95%]"
            else:
                ratio = _flat(table, shape, key, sizes)
                text = ratio.fmt(1, 2)
            result.metric(f"{shape.replace('-', '_')}_{name}_ratio", ratio, "x")
            verdicts.append(ratio.median <= limit)
            texts.append(f"{shape} {key} {text}x")
        result.metric(f"{shape.replace('-', '_')}_history_ratio", _flat(table, shape, "history", sizes), "x")
    result.runs = ctx.runs
    result.value = f"{sizes[-1]:,} / {sizes[0]:,} events: " + "; ".join(texts)
    result.baseline = "each command and the save on a new ledger (0 events), in the same runs"
    result.met = all(verdicts)
    result.side(
        "each size",
        durability="full",
        transport="loopback HTTP (commands and saves against a fresh 4-server cluster per shape and run)",
        order="commands: sizes interleaved, ascending and descending in turn per run; saves: every size's"
        " coordinator and a null one in one process, in rotating order round after round",
        ledger="a private copy of the cached history (recorded real cycles); 0: new, at the schema head",
    )
    result.notes.append(
        "commands: a new interpreter each, timed from spawn to exit (Python's start-up and the CLI's"
        " imports included); `checkpoint` runs first so that `show latest` has an attempt on the new"
        " ledger; `history` without --limit reads every attempt: shown, not judged"
    )
    result.notes.append(
        f"save's ledger CPU: the thread CPU of the ledger's own code per save, counted where it runs (on"
        f" the event loop, between its awaits, and on worker threads), {cycles} saves per size and run"
        " (measure #3's cluster and settle time), every size's saves interleaved in one process per shape"
        " and run; judged on the median of every run's saves pooled per size, with a 95% interval of the"
        " ratio by a two-level bootstrap — runs (as pairs: the sizes of a run shared its process), then"
        " each run's saves (as min–max in the JSON). real − null (the same"
        " process's CPU per save with a null ledger subtracted: it also holds what the ledger's work"
        " costs other code, but its interval spans about ±30%) is shown beside, not judged"
    )
    return result
