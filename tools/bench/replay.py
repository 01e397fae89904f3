"""Measure #5 — replay (rebuild projections + verify the chain) over 1,000,000 events vs a raw read.

The ledger is generated once (``tools.bench.ledger._fill``: realistic attempts — ``attempt.started``,
48 ``call.sent``/``call.replied`` pairs, ``attempt.completed`` — appended with ``append_many`` in
batches of 5,000 at ``durability="process"``) and cached under ``bench-results/.cache``; a cached
file the current schema refuses is regenerated.

Each run is a fresh process: ``run_replay`` calls ``ledger.replay_url`` (streams every event,
recomputes every hash, folds the ``attempts`` projection and compares it with the live table) and
``run_raw`` reads the same rows with the standard library's ``sqlite3`` (``SELECT * FROM events
ORDER BY seq``, ``fetchmany``): the floor. Runs alternate. Goals: replay >= 200,000 events/s and
peak RSS <= 200 MB, counting replay's worker processes (see ``measure``).
"""

from __future__ import annotations

import os
import resource
import sqlite3
import time
from pathlib import Path
from typing import Any

import anyio

from ledger import Ledger, LedgerError, replay_url
from tools.bench.harness import BenchError, Context, Result, run_child, stats_of
from tools.bench.ledger import _fill

EVENTS = 1_000_000
QUICK_EVENTS = 20_000


def generate(path: str, n: int) -> dict[str, Any]:
    """Write an ``n``-event ledger at ``path`` (via a temporary name, renamed when complete)."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    for leftover in target.parent.glob(tmp.name + "*"):
        leftover.unlink()
    start = time.perf_counter()
    anyio.run(_fill, f"sqlite+aiosqlite:///{tmp}", n)
    for suffix in ("-wal", "-shm"):
        if Path(f"{tmp}{suffix}").exists():
            raise BenchError(f"{tmp}{suffix} left behind after close")
    os.replace(tmp, target)
    return {"seconds": time.perf_counter() - start}


async def usable(path: str, n: int) -> dict[str, Any]:
    """Whether the cached ledger at ``path`` opens with this code and holds ``n`` events."""
    try:
        async with Ledger.open(f"sqlite+aiosqlite:///{path}", readonly=True) as ledger:
            head = await ledger.head()
    except LedgerError as error:
        return {"ok": False, "why": str(error)}
    return {"ok": head is not None and head.seq == n, "why": f"head {head.seq if head else None}"}


async def run_replay(path: str) -> dict[str, Any]:
    start = time.perf_counter()
    cpu = time.process_time()
    report = await replay_url(f"sqlite+aiosqlite:///{path}")
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "events": report.events,
        "seconds": seconds,
        "events_per_s": report.events / seconds,
        "ok": report.ok,
        # replay's worker processes, all ended and waited for: RUSAGE_CHILDREN holds the largest
        # peak RSS among them, and their CPU time.
        "workers": report.workers,
        "worker_peak_rss_mb": children.ru_maxrss / 1024 if report.workers else 0.0,
        "cpu_s": cpu + children.ru_utime + children.ru_stime,
    }


def run_raw(path: str) -> dict[str, Any]:
    start = time.perf_counter()
    cpu = time.process_time()
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    cursor = conn.execute("SELECT * FROM events ORDER BY seq")
    count = 0
    while rows := cursor.fetchmany(5000):
        count += len(rows)
    conn.close()
    seconds = time.perf_counter() - start
    return {"events": count, "seconds": seconds, "events_per_s": count / seconds,
            "cpu_s": time.process_time() - cpu}  # fmt: skip


def ensure_ledger(ctx: Context, n: int) -> Path:
    """The cached ``n``-event ledger (generated when missing or refused by this code)."""
    path = ctx.cache / f"replay-{n}.db"
    if path.exists() and run_child("replay:usable", {"path": str(path), "n": n})["ok"]:
        return path
    ctx.log(f"  generating a {n:,}-event ledger in {path}")
    done = run_child("replay:generate", {"path": str(path), "n": n}, timeout_s=3600)
    ctx.log(f"  generated in {done['seconds']:.0f} s")
    return path


def measure(ctx: Context) -> Result:
    """Measure #5 (see the module docstring)."""
    n = QUICK_EVENTS if ctx.quick else EVENTS
    result = Result(5, f"replay {n:,} events (rebuild projections + verify chain)",
                    ">= 200,000 events/s and peak RSS <= 200 MB")  # fmt: skip
    path = ensure_ledger(ctx, n)
    replays: list[dict[str, Any]] = []
    raws: list[dict[str, Any]] = []
    for index in range(ctx.runs):
        raws.append(run_child("replay:run_raw", {"path": str(path)}))
        replays.append(run_child("replay:run_replay", {"path": str(path)}, timeout_s=1800))
        ctx.log(f"  run {index + 1}/{ctx.runs}: replay {replays[-1]['events_per_s']:,.0f} events/s,"
                f" raw {raws[-1]['events_per_s']:,.0f} events/s")  # fmt: skip
    if not all(r["ok"] and r["events"] == n for r in replays):
        raise BenchError(f"replay did not verify the generated ledger: {replays}")
    rate, raw_rate = stats_of(replays, "events_per_s"), stats_of(raws, "events_per_s")
    for run in replays:  # an upper bound of the sum: the replay process and its workers at their peaks
        run["total_peak_rss_mb"] = run["peak_rss_mb"] + run["workers"] * run["worker_peak_rss_mb"]
    rss = stats_of(replays, "total_peak_rss_mb")
    result.runs = len(replays)
    result.metric("replay_events_per_s", rate, "events/s")
    result.metric("replay_seconds", stats_of(replays, "seconds"), "s")
    result.metric("raw_events_per_s", raw_rate, "events/s")
    result.metric("peak_rss_mb", rss, "MB")
    result.metric("replay_process_peak_rss_mb", stats_of(replays, "peak_rss_mb"), "MB")
    result.metric("worker_peak_rss_mb", stats_of(replays, "worker_peak_rss_mb"), "MB")
    result.metric("replay_cpu_s", stats_of(replays, "cpu_s"), "s")
    result.metric("raw_peak_rss_mb", stats_of(raws, "peak_rss_mb"), "MB")
    result.metric("raw_cpu_s", stats_of(raws, "cpu_s"), "s")
    result.value = f"{rate.fmt(1, 0, 'events/s')}; peak RSS {rss.fmt(1, 0, 'MB')}"
    result.baseline = (
        f"raw sqlite3 read of the same rows: {raw_rate.fmt(1, 0, 'events/s')}"
        f" (replay takes {raw_rate.median / rate.median:.1f}x as long)"
    )
    result.met = rate.median >= 200_000 and rss.median <= 200
    size = path.stat().st_size / 1e6
    result.notes.append(f"ledger file {size:.0f} MB, cached in {ctx.cache}")
    workers = replays[0]["workers"]
    result.notes.append(
        f"replay runs {workers} worker processes; its peak RSS is the replay process's VmHWM plus "
        f"{workers} x the largest worker peak (RUSAGE_CHILDREN ru_maxrss), an upper bound of their sum; "
        "CPU seconds count the replay process and its workers"
    )
    return result
