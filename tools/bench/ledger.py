"""Measure #1 — ledger append cost against raw ``sqlite3`` commits, on the same disk, in one run.

``python -m quiesce.tools.bench --only 1`` runs it as part of the bench (``measure``: fresh processes,
median/min/max over runs, peak RSS); standalone:

    python -m quiesce.tools.bench.ledger [--n 400] [--dir DIR] [--replay N] [--json]

Prints the median seconds per durable ``append`` (``call.sent``), per pair of appends (one
recorded call: ``call.sent`` + ``call.replied``), per pair of raw ``sqlite3`` commits (WAL,
``synchronous=FULL``, a row like an events row in a table with the same columns and indexes),
and the ratio pair / raw pair (goal: <= 1.5). Both databases live in one temporary folder
(``--dir``, default the system temp dir), so they share a filesystem; the three measurements are
interleaved iteration by iteration, in a rotating order (each of the six orders in turn), so that
other load on the machine, and whatever the previous fsync left behind, affect them alike.

``--replay N`` also appends N events (batched) to a fresh ledger and times ``quiesce.ledger.replay``
over it, reporting events/s and the peak RSS of that phase (goals: >= 200k events/s, <= 200 MB).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from quiesce.ledger import AppendItem, Ledger, replay_url
from quiesce.ledger.layout import MARKER_WHERE_SQLITE
from quiesce.tools.bench.harness import Context, Result, repeat, stats_of

RAW_DDL = (
    "CREATE TABLE events (seq INTEGER PRIMARY KEY, at VARCHAR(32) NOT NULL, kind VARCHAR(64) NOT NULL, "
    "checkpoint_id VARCHAR(128), server VARCHAR(256), call_id VARCHAR(128), epoch BIGINT NOT NULL, "
    "data TEXT NOT NULL, prev_hash VARCHAR(64) NOT NULL, hash VARCHAR(64) NOT NULL)",
    "CREATE INDEX ix_events_checkpoint_id ON events (checkpoint_id, seq)",
    f"CREATE INDEX ix_events_marker ON events (kind, seq) WHERE {MARKER_WHERE_SQLITE}",
)

SENT: dict[str, Any] = {
    "phase": "prepare",
    "method": "POST",
    "path": "/ng-control/v1/agent-checkpoint/prepare",
    "url": "http://127.0.0.1:8003",
    "timeout_s": 29.5,
    "body": {"schema_version": 1, "checkpoint_id": "ckpt-e1-0001", "deadline_ts": 1760000000.25},
}
REPLIED: dict[str, Any] = {
    "status": 200,
    "elapsed_s": 0.0123,
    "body": {"state": "prepared", "ready_to_commit": True, "running": 0, "parked": 12, "active": 12},
}


class _Raw:
    """Raw ``sqlite3`` commits of events-like rows: the floor an append is compared with."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        for ddl in RAW_DDL:
            self.conn.execute(ddl)
        self.sent, self.replied = json.dumps(SENT, sort_keys=True), json.dumps(REPLIED, sort_keys=True)
        self.seq = 0

    def pair(self, i: int) -> None:
        for kind, data in (("call.sent", self.sent), ("call.replied", self.replied)):
            self.seq += 1
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.execute(
                "INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (self.seq, "2025-01-01T00:00:00.000000Z", kind, "ckpt-e1-0001", "agent", f"c{i}", 1, data,
                 "0" * 64, "f" * 64),
            )  # fmt: skip
            self.conn.execute("COMMIT")


async def _measure(folder: Path, n: int) -> tuple[list[float], list[float], list[float]]:
    """Interleaves raw pairs, single appends and pairs of appends, so load on the machine hits all alike."""
    raw = _Raw(folder / "raw.db")
    singles: list[float] = []
    pairs: list[float] = []
    raws: list[float] = []
    async with Ledger.open(f"sqlite+aiosqlite:///{folder / 'ledger.db'}", secrets=["s3cr3t-token"]) as ledger:
        await ledger.start_epoch(
            {"coordinator": {"host": "bench", "pid": os.getpid(), "uuid": "u"}, "version": "b"}
        )
        await ledger.append(
            "attempt.started",
            checkpoint_id="ckpt-e1-0001",
            data={"kind": "save", "deadline_ts": 1760000000.25, "participants": ["policy_model", "agent"]},
        )

        async def raw_pair(i: int) -> None:
            raw.pair(i)

        async def single(i: int) -> None:
            await ledger.append(
                "call.sent", checkpoint_id="ckpt-e1-0001", server="agent", call_id=f"s{i}", data=SENT
            )

        async def pair(i: int) -> None:
            await ledger.append(
                "call.sent", checkpoint_id="ckpt-e1-0001", server="agent", call_id=f"p{i}", data=SENT
            )
            await ledger.append(
                "call.replied", checkpoint_id="ckpt-e1-0001", server="agent", call_id=f"p{i}", data=REPLIED
            )

        sides = {"raw": (raw_pair, raws), "single": (single, singles), "pair": (pair, pairs)}
        orders = list(itertools.permutations(sides))
        warm = n // 10
        for i in range(n + warm):
            # every order of the three in turn: whichever runs first after the previous fsync
            # (or second, or third) is not always the same side
            for name in orders[i % len(orders)]:
                step, out = sides[name]
                start = time.perf_counter()
                await step(i)
                took = time.perf_counter() - start
                if i >= warm:
                    out.append(took)
    raw.conn.close()
    return singles, pairs, raws


async def _fill(url: str, n: int) -> None:
    async with Ledger.open(url, durability="process") as ledger:
        await ledger.start_epoch(
            {"coordinator": {"host": "bench", "pid": os.getpid(), "uuid": "u"}, "version": "b"}
        )
        batch: list[AppendItem] = []
        done = 1
        attempt = 0
        while done < n:
            cid = f"ckpt-e1-{attempt:06d}"
            attempt += 1
            batch.append(
                AppendItem(
                    "attempt.started",
                    checkpoint_id=cid,
                    data={"kind": "save", "deadline_ts": 1.0, "participants": ["a"]},
                )
            )
            for j in range(48):
                batch.append(
                    AppendItem(
                        "call.sent", checkpoint_id=cid, server="agent", call_id=f"{cid}-{j}", data=SENT
                    )
                )
                batch.append(
                    AppendItem(
                        "call.replied", checkpoint_id=cid, server="agent", call_id=f"{cid}-{j}", data=REPLIED
                    )
                )
            batch.append(
                AppendItem(
                    "attempt.completed", checkpoint_id=cid, data={"servers": ["a"], "outcome": "published"}
                )
            )
            if len(batch) >= 5000:
                await ledger.append_many(batch[: n - done])
                done += min(len(batch), n - done)
                batch = []
        if batch and done < n:
            await ledger.append_many(batch[: n - done])


async def run_once(n: int, dir: str | None = None) -> dict[str, Any]:
    """One run of measure #1 (in a child process): medians of ``n`` interleaved iterations."""
    folder = Path(tempfile.mkdtemp(prefix="quiesce-bench-", dir=dir))
    try:
        singles, pairs, raws = await _measure(folder, n)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    append_pair_s, raw_pair_s = statistics.median(pairs), statistics.median(raws)
    return {
        "append_s": statistics.median(singles),
        "append_pair_s": append_pair_s,
        "raw_pair_s": raw_pair_s,
        "ratio": append_pair_s / raw_pair_s,
    }


def measure(ctx: Context) -> Result:
    """Measure #1: one recorded call (two durable appends) vs two raw ``sqlite3`` commits.

    Each run is a fresh process that interleaves, iteration by iteration, a pair of raw commits
    (WAL, ``synchronous=FULL``), a single ``append`` and a pair of appends (``call.sent`` +
    ``call.replied``) on two databases in one folder of the bench's work dir (the same disk), and
    reports the median of each; the ratio pair / raw pair is computed per run. Goal: <= 1.5.
    """
    n = 30 if ctx.quick else 300
    result = Result(1, "recorded call = two durable appends", "ratio <= 1.5 vs two raw sqlite3 commits")
    runs = repeat("ledger:run_once", {"n": n, "dir": str(ctx.work)}, ctx.runs, log=ctx.log)
    ratio = stats_of(runs, "ratio")
    pair, raw = stats_of(runs, "append_pair_s"), stats_of(runs, "raw_pair_s")
    result.metric("append_pair_s", pair, "s")
    result.metric("raw_pair_s", raw, "s")
    result.metric("append_s", stats_of(runs, "append_s"), "s")
    result.metric("ratio", ratio, "x")
    result.metric("peak_rss_mb", stats_of(runs, "peak_rss_mb"), "MB")
    result.runs = len(runs)
    result.value = f"{pair.fmt(1e3, 3, 'ms')} per pair; ratio {ratio.fmt(1, 2)}"
    result.baseline = f"{raw.fmt(1e3, 3, 'ms')} per pair of raw commits (WAL, synchronous=FULL)"
    result.met = ratio.median <= 1.5
    order = "rotated: each iteration runs the three in the next of the six orders"
    result.side("raw pair", durability="WAL, synchronous=FULL (fsync at every COMMIT)", transport="none",
                order=order)  # fmt: skip
    result.side(
        "ledger pair (call.sent + call.replied)",
        durability="full, both appends durable (WAL fdatasynced after each COMMIT)",
        transport="none",
        order=order,
    )
    result.notes.append(f"{n} interleaved iterations per run (after {n // 10} warm-up)")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m quiesce.tools.bench.ledger", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--n", type=int, default=400, help="measured appends / pairs (after 10%% warm-up)")
    parser.add_argument(
        "--dir", default=None, help="folder for the temporary databases (default: system temp)"
    )
    parser.add_argument("--replay", type=int, default=0, metavar="N", help="also time replay over N events")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    folder = Path(tempfile.mkdtemp(prefix="quiesce-bench-", dir=args.dir))
    try:
        singles, pairs, raw = anyio.run(_measure, folder, args.n)
        result: dict[str, Any] = {
            "dir": str(folder),
            "n": args.n,
            "append_s": statistics.median(singles),
            "append_pair_s": statistics.median(pairs),
            "raw_pair_s": statistics.median(raw),
        }
        result["ratio"] = result["append_pair_s"] / result["raw_pair_s"]
        if args.replay:
            url = f"sqlite+aiosqlite:///{folder / 'replay.db'}"
            anyio.run(_fill, url, args.replay)
            rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            start = time.perf_counter()
            report = anyio.run(lambda: replay_url(url))
            elapsed = time.perf_counter() - start
            result["replay"] = {
                "events": report.events,
                "seconds": elapsed,
                "events_per_s": report.events / elapsed,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "peak_rss_mb_before": rss_before / 1024,
                "ok": report.ok,
            }
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"folder                        {result['dir']}")
        print(f"median durable append         {result['append_s'] * 1e6:9.1f} us")
        print(
            f"median pair of appends        {result['append_pair_s'] * 1e6:9.1f} us  "
            "(call.sent + call.replied)"
        )
        print(
            f"median pair of raw commits    {result['raw_pair_s'] * 1e6:9.1f} us  "
            "(sqlite3, WAL, synchronous=FULL)"
        )
        print(f"ratio pair / raw pair         {result['ratio']:9.2f}    (goal <= 1.5)")
        if "replay" in result:
            r = result["replay"]
            print(
                f"replay                        {r['events']} events in {r['seconds']:.2f} s = "
                f"{r['events_per_s']:,.0f} events/s, peak RSS {r['peak_rss_mb']:.0f} MB, ok={r['ok']}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
