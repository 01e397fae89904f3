"""Measure #5 — replay (rebuild projections + verify the chain) of a 1,000,000-event ledger of real cycles.

The ledger is ``quiesce.tools.bench.history``'s: recorded real cycles (saves, a rolled-back save, a crash
and its recovery, a restore and its resume, on clusters of 4, 16 and 64 servers) appended again
and again with fresh checkpoint ids until it holds 1,000,000 events; cached under
``bench-results/.cache``.

Each run is a fresh process: ``run_replay`` calls ``ledger.replay_url`` (streams every event,
recomputes every hash, folds the ``attempts`` projection and compares it with the live table) and
``run_raw`` reads the same rows with the standard library's ``sqlite3`` (``SELECT * FROM events
ORDER BY seq``, ``fetchmany``): the floor. Runs alternate, the first side alternating too. Reported:
events/s, MB/s (the ledger file's size over the time), CPU seconds (the replay process and its
workers), and the peak of the summed RSS of the replay process and every worker process it
starts, sampled together (``harness.TreeRss``). Goals: >= 200,000 events/s and <= 200 MB, judged
warm. Each run also times both sides cold, the ledger's files dropped from the page cache before
each (``pagecache.evict``); replay uses several processes, the raw read one (both are reported).
"""

from __future__ import annotations

import resource
import sqlite3
import time
from typing import Any

from quiesce.ledger import replay_url
from quiesce.tools.bench.harness import BenchError, Context, Result, run_child, stats_of
from quiesce.tools.bench.history import history
from quiesce.tools.bench.pagecache import evict, ledger_files

EVENTS = 1_000_000
QUICK_EVENTS = 5_000


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


def rate_text(runs: list[dict[str, Any]]) -> str:
    return stats_of(runs, "events_per_s").fmt(1, 0)


def measure(ctx: Context) -> Result:
    """Measure #5 (see the module docstring)."""
    n = QUICK_EVENTS if ctx.quick else EVENTS
    result = Result(5, f"replay {n:,} events of recorded real cycles (rebuild projections + verify chain)",
                    ">= 200,000 events/s and summed peak RSS <= 200 MB")  # fmt: skip
    path = history(ctx, n)
    size_mb = path.stat().st_size / 1e6
    replays: list[dict[str, Any]] = []
    raws: list[dict[str, Any]] = []
    cold: dict[str, list[dict[str, Any]]] = {"replay": [], "raw": []}
    files = ledger_files(path)
    for index in range(ctx.runs):
        for cache in ("warm", "cold"):
            for side in ("raw", "replay") if index % 2 == 0 else ("replay", "raw"):
                left = evict(files) if cache == "cold" else None
                if side == "raw":
                    run = run_child("replay:run_raw", {"path": str(path)})
                else:
                    run = run_child("replay:run_replay", {"path": str(path)}, timeout_s=1800, tree_rss=True)
                if left is not None:
                    run["resident_before"] = left
                    cold[side].append(run)
                else:
                    (raws if side == "raw" else replays).append(run)
        ctx.log(f"  run {index + 1}/{ctx.runs}: replay {replays[-1]['events_per_s']:,.0f} events/s"
                f" (cold {cold['replay'][-1]['events_per_s']:,.0f}),"
                f" raw {raws[-1]['events_per_s']:,.0f} events/s"
                f" (cold {cold['raw'][-1]['events_per_s']:,.0f}),"
                f" summed RSS {replays[-1]['tree_peak_rss_mb']:.0f} MB")  # fmt: skip
    events = replays[0]["events"]
    if not all(r["ok"] and r["events"] == events and events >= n for r in replays + cold["replay"]):
        raise BenchError(f"replay did not verify the ledger: {replays + cold['replay']}")
    for run in replays + raws + cold["replay"] + cold["raw"]:
        run["mb_per_s"] = size_mb / run["seconds"]
    cold_rate, cold_raw = stats_of(cold["replay"], "events_per_s"), stats_of(cold["raw"], "events_per_s")
    result.metric("cold_replay_events_per_s", cold_rate, "events/s")
    result.metric("cold_replay_mb_per_s", stats_of(cold["replay"], "mb_per_s"), "MB/s")
    result.metric("cold_raw_events_per_s", cold_raw, "events/s")
    result.metric("cold_resident_before", stats_of(cold["replay"] + cold["raw"], "resident_before"), "")
    result.rows.append({"cache": "warm (the ledger just read)", "replay (events/s)": rate_text(replays),
                        "raw read (events/s)": rate_text(raws)})  # fmt: skip
    result.rows.append({"cache": "cold (the ledger dropped from the page cache)",
                        "replay (events/s)": rate_text(cold["replay"]),
                        "raw read (events/s)": rate_text(cold["raw"])})  # fmt: skip
    rate, raw_rate = stats_of(replays, "events_per_s"), stats_of(raws, "events_per_s")
    rss = stats_of(replays, "tree_peak_rss_mb")
    cpu = stats_of(replays, "cpu_s")
    mbps = stats_of(replays, "mb_per_s")
    result.runs = len(replays)
    result.metric("replay_events_per_s", rate, "events/s")
    result.metric("replay_mb_per_s", mbps, "MB/s")
    result.metric("replay_seconds", stats_of(replays, "seconds"), "s")
    result.metric("replay_cpu_s", cpu, "s")
    result.metric("raw_events_per_s", raw_rate, "events/s")
    result.metric("raw_mb_per_s", stats_of(raws, "mb_per_s"), "MB/s")
    result.metric("peak_rss_mb", rss, "MB")
    result.metric("replay_process_peak_rss_mb", stats_of(replays, "peak_rss_mb"), "MB")
    result.metric("worker_peak_rss_mb", stats_of(replays, "worker_peak_rss_mb"), "MB")
    result.metric("raw_cpu_s", stats_of(raws, "cpu_s"), "s")
    result.metric("raw_peak_rss_mb", stats_of(raws, "peak_rss_mb"), "MB")
    result.value = (
        f"{rate.fmt(1, 0, 'events/s')} = {mbps.fmt(1, 0, 'MB/s')}; {cpu.fmt(1, 1, 'CPU-s')};"
        f" summed peak RSS {rss.fmt(1, 0, 'MB')}"
    )
    result.baseline = (
        f"raw sqlite3 read of the same rows in one process: {raw_rate.fmt(1, 0, 'events/s')}"
        f" (replay, {replays[0]['workers'] + 1} processes, takes {raw_rate.median / rate.median:.1f}x as"
        f" long); cold page cache: replay {cold_rate.fmt(1, 0, 'events/s')},"
        f" raw {cold_raw.fmt(1, 0, 'events/s')}"
    )
    result.met = rate.median >= 200_000 and rss.median <= 200
    workers = replays[0]["workers"]
    result.side("replay", durability="read only", transport="none",
                order="alternating with the raw read, first side alternating per run",
                processes=f"the replay process and its {workers} worker process(es)")  # fmt: skip
    result.side("raw read", durability="read only", transport="none", order="the same", processes="one")
    result.notes.append(
        f"ledger file {size_mb:.0f} MB, {events:,} events made of recorded real cycles"
        f" (tools/bench/history.py), cached in {ctx.cache}"
    )
    result.notes.append(
        "cold: before each cold run the ledger's files are fdatasynced and dropped from the page cache"
        " with posix_fadvise(POSIX_FADV_DONTNEED) (tools/bench/pagecache.py; mincore(2) found"
        f" {stats_of(cold['replay'] + cold['raw'], 'resident_before').fmt(1, 3)} of their pages cached"
        " before each such run); the interpreter and quiesce's code stay cached. The goal is judged warm,"
        " as before; the cold figures stand beside it"
    )
    result.notes.append(
        f"summed peak RSS: the replay process and its {workers} worker(s), sampled together every 50 ms"
        f" (each process's own VmHWM: replay process {stats_of(replays, 'peak_rss_mb').fmt(1, 0, 'MB')},"
        f" largest worker {stats_of(replays, 'worker_peak_rss_mb').fmt(1, 0, 'MB')}); CPU seconds count the"
        " replay process and its workers"
    )
    return result
