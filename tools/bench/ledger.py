"""Measure #1 — ledger append cost against raw ``sqlite3`` commits, on the same disk, in one run, in
steady state.

``python -m quiesce.tools.bench --only 1`` runs it as part of the bench (``measure``: fresh processes,
median/min/max over runs, peak RSS); standalone:

    python -m quiesce.tools.bench.ledger [--n 1500] [--dir DIR] [--replay N] [--json]

Prints the median seconds per durable ``append`` (``call.sent``), per pair of appends (one
recorded call: ``call.sent`` + ``call.replied``), per pair of raw ``sqlite3`` commits of a row
like an events row in a table with the same columns and indexes — with ``synchronous=FULL``, and
with ``synchronous=NORMAL`` plus an ``fdatasync`` of the WAL after each COMMIT (the ledger's own
durability) — and the ratios pair / raw pair (goal: <= 1.4 against both). Every side has its own
database in one temporary folder (``--dir``, default the system temp dir), so they share a
filesystem; the four are interleaved iteration by iteration, in a rotating order, so that other
load on the machine, and whatever the previous fsync left behind, affect them alike; and nothing is
timed until every side's WAL has been restarted from its beginning twice (a commit that grows the
WAL file costs about twice one that rewrites it, and the ledger, writing more pages per commit,
wraps first). Each side's WAL frames per commit and (ledger and NORMAL) fdatasync calls per commit
are reported; a run whose two fsync counts differ is refused.

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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from quiesce.ledger import AppendItem, Ledger, replay_url
from quiesce.ledger.layout import MARKER_WHERE_SQLITE
from quiesce.tools.bench.harness import Context, Result, Stats, repeat, stats_of

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


async def recorded_call(ledger: Ledger, call_id: str) -> None:
    """One recorded call as the coordinator writes it: ``call.sent`` then ``call.replied`` (``SENT``,
    ``REPLIED``), each a durable append of its own."""
    for kind, data in (("call.sent", SENT), ("call.replied", REPLIED)):
        await ledger.append(kind, checkpoint_id="ckpt-e1-0001", server="agent", call_id=call_id, data=data)


class _Raw:
    """Raw ``sqlite3`` commits of events-like rows, each on its own database: the floor an append is
    compared with. ``full``: WAL with ``synchronous=FULL`` (SQLite syncs the WAL at every COMMIT);
    ``normal``: ``synchronous=NORMAL`` plus an ``fdatasync`` of the WAL after every COMMIT — the
    ledger's own durability, done the ledger's way."""

    def __init__(self, path: Path, mode: str) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL" if mode == "full" else "PRAGMA synchronous=NORMAL")
        for ddl in RAW_DDL:
            self.conn.execute(ddl)
        self.path, self.mode = path, mode
        self.sent, self.replied = json.dumps(SENT, sort_keys=True), json.dumps(REPLIED, sort_keys=True)
        self.seq = 0
        self.fsyncs = 0
        self._wal_fd: int | None = None

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
            if self.mode == "normal":
                if self._wal_fd is None:
                    self._wal_fd = os.open(wal_of(self.path), os.O_RDONLY | os.O_CLOEXEC)
                os.fdatasync(self._wal_fd)
                self.fsyncs += 1

    def close(self) -> None:
        if self._wal_fd is not None:
            os.close(self._wal_fd)
        self.conn.close()


def wal_of(database: Path) -> Path:
    return database.with_name(database.name + "-wal")


def wal_resets(database: Path) -> int:
    """How often SQLite has restarted the WAL of ``database`` from its beginning (the header's
    checkpoint sequence number, bytes 12-16, big-endian; 0 before the first reset or without a WAL)."""
    try:
        with open(wal_of(database), "rb") as wal:
            header = wal.read(32)
    except FileNotFoundError:
        return 0
    return int.from_bytes(header[12:16], "big") if len(header) == 32 else 0


def wal_frames(database: Path) -> int | None:
    """The number of valid frames in the WAL of ``database`` now: ``mxFrame`` of the WAL-index header
    at the start of its ``-shm`` file (offset 16, native byte order); None if it cannot be read."""
    try:
        with open(database.with_name(database.name + "-shm"), "rb") as shm:
            header = shm.read(20)
    except FileNotFoundError:
        return None
    return int.from_bytes(header[16:20], sys.byteorder) if len(header) == 20 else None


#: Steady state: every side's WAL has been restarted from its beginning this many times before
#: the timed iterations (an append that grows the file costs about twice one that rewrites it).
WARM_RESETS = 2
#: A warm-up that has not reached ``WARM_RESETS`` after this many iterations is a failed run.
WARM_MAX = 20_000
#: Commits per side whose WAL frames are counted (untimed, after the timed iterations).
FRAME_PROBES = 60


class _Counted:
    """Counts the ledger's WAL ``fdatasync`` calls (``SqliteBackend._fsync_wal``) in this process."""

    def __init__(self) -> None:
        from quiesce.ledger import sqlite as backend

        self.calls = 0
        self._backend = backend
        self._original = backend.SqliteBackend._fsync_wal

    def __enter__(self) -> _Counted:
        original = self._original

        def counted(this: Any) -> None:
            self.calls += 1
            original(this)

        self._backend.SqliteBackend._fsync_wal = counted  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        self._backend.SqliteBackend._fsync_wal = self._original  # type: ignore[method-assign]


async def _measure(folder: Path, n: int) -> dict[str, Any]:
    """Interleaves, iteration by iteration, a raw pair (FULL), a raw pair (NORMAL + fdatasync), a
    single append and a pair of appends — each on its own database — in steady state (every WAL
    restarted ``WARM_RESETS`` times first); returns each side's samples and counts."""
    raws = {
        "raw": _Raw(folder / "raw-full.db", "full"),
        "raw_normal": _Raw(folder / "raw-normal.db", "normal"),
    }
    paths = {
        "raw": folder / "raw-full.db",
        "raw_normal": folder / "raw-normal.db",
        "single": folder / "single.db",
        "pair": folder / "ledger.db",
    }
    identity = {"coordinator": {"host": "bench", "pid": os.getpid(), "uuid": "u"}, "version": "b"}
    started = {"kind": "save", "deadline_ts": 1760000000.25, "participants": ["policy_model", "agent"]}
    out: dict[str, Any] = {}
    with _Counted() as fsyncs:
        async with (
            Ledger.open(f"sqlite+aiosqlite:///{paths['pair']}", secrets=["s3cr3t-token"]) as ledger,
            Ledger.open(f"sqlite+aiosqlite:///{paths['single']}", secrets=["s3cr3t-token"]) as alone,
        ):
            for each in (ledger, alone):
                await each.start_epoch(identity)
                await each.append("attempt.started", checkpoint_id="ckpt-e1-0001", data=started)

            async def raw_pair(i: int) -> None:
                raws["raw"].pair(i)

            async def raw_normal_pair(i: int) -> None:
                raws["raw_normal"].pair(i)

            async def single(i: int) -> None:
                await alone.append(
                    "call.sent", checkpoint_id="ckpt-e1-0001", server="agent", call_id=f"s{i}", data=SENT
                )

            async def pair(i: int) -> None:
                await recorded_call(ledger, f"p{i}")

            steps = {"raw": raw_pair, "raw_normal": raw_normal_pair, "single": single, "pair": pair}
            commits = {"raw": 2, "raw_normal": 2, "single": 1, "pair": 2}  # per iteration
            i = 0
            while min(wal_resets(path) for path in paths.values()) < WARM_RESETS:
                if i >= WARM_MAX:
                    raise RuntimeError(f"no steady state after {WARM_MAX} warm-up iterations")
                for step in steps.values():
                    await step(i)
                i += 1
            out["warmup_iterations"] = i
            resets = {side: wal_resets(path) for side, path in paths.items()}
            before = {"ledger": fsyncs.calls, "raw_normal": raws["raw_normal"].fsyncs}
            samples: dict[str, list[float]] = {side: [] for side in steps}
            orders = list(itertools.permutations(steps))
            for j in range(n):
                # every order of the four in turn: whichever runs first after the previous fsync (or
                # second, ...) is not always the same side
                for side in orders[j % len(orders)]:
                    start = time.perf_counter()
                    await steps[side](i + j)
                    samples[side].append(time.perf_counter() - start)
            out["samples"] = samples
            out["resets"] = {side: wal_resets(path) - resets[side] for side, path in paths.items()}
            ledger_commits = n * (commits["single"] + commits["pair"])
            out["fsyncs_per_commit"] = {
                "ledger": (fsyncs.calls - before["ledger"]) / ledger_commits,
                "raw_normal": (raws["raw_normal"].fsyncs - before["raw_normal"])
                / (n * commits["raw_normal"]),
            }
            # untimed: WAL frames each side writes per commit (a sample across a WAL restart is dropped)
            frames: dict[str, list[float]] = {side: [] for side in steps}
            for k in range(FRAME_PROBES):
                for side, step in steps.items():
                    first = wal_frames(paths[side])
                    await step(i + n + k)
                    last = wal_frames(paths[side])
                    if first is not None and last is not None and last >= first:
                        frames[side].append((last - first) / commits[side])
            out["frames_per_commit"] = {s: statistics.median(v) if v else None for s, v in frames.items()}
    for raw in raws.values():
        raw.close()
    return out


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
    """One run of measure #1 (in a child process): medians of ``n`` interleaved steady-state
    iterations, each side's WAL frames and fsyncs per commit, and its samples. A run whose ledger
    and raw NORMAL sides did not fsync alike (one per commit each) is refused (``RuntimeError``)."""
    folder = Path(tempfile.mkdtemp(prefix="quiesce-bench-", dir=dir))
    try:
        out = await _measure(folder, n)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    fsyncs = out["fsyncs_per_commit"]
    if abs(fsyncs["ledger"] - 1.0) > 1e-9 or abs(fsyncs["raw_normal"] - 1.0) > 1e-9:
        raise RuntimeError(f"the two sides did not fsync alike (one fdatasync per commit each): {fsyncs}")
    medians = {side: statistics.median(values) for side, values in out["samples"].items()}
    return {
        **out,
        "append_s": medians["single"],
        "append_pair_s": medians["pair"],
        "raw_pair_s": medians["raw"],
        "raw_normal_pair_s": medians["raw_normal"],
        "ratio": medians["pair"] / medians["raw"],
        "ratio_normal": medians["pair"] / medians["raw_normal"],
    }


def measure(ctx: Context) -> Result:
    """Measure #1: one recorded call (two durable appends) vs two raw ``sqlite3`` commits, in steady state.

    Each run is a fresh process that interleaves, iteration by iteration, a pair of raw commits
    with ``synchronous=FULL``, a pair of raw commits with ``synchronous=NORMAL`` + ``fdatasync``
    (the ledger's own durability), a single ``append`` and a pair of appends (``call.sent`` +
    ``call.replied``), each on its own database in one folder of the bench's work dir (the same
    disk), after a warm-up that has restarted every side's WAL twice: no side is timed while its WAL
    file still grows (such commits cost about twice as much, and the ledger's, writing more pages,
    wraps first). Goal: the pair / raw pair <= 1.4 against both baselines.
    """
    n = 30 if ctx.quick else 1500
    result = Result(
        1,
        "recorded call = two durable appends, steady state",
        "ratio <= 1.4 vs two raw sqlite3 commits (FULL, and NORMAL + fdatasync), every WAL wrapped",
    )
    runs = repeat("ledger:run_once", {"n": n, "dir": str(ctx.work)}, ctx.runs, log=ctx.log)
    ratio, ratio_normal = stats_of(runs, "ratio"), stats_of(runs, "ratio_normal")
    pair, raw = stats_of(runs, "append_pair_s"), stats_of(runs, "raw_pair_s")
    raw_normal = stats_of(runs, "raw_normal_pair_s")
    for name, figure, unit in (
        ("append_pair_s", pair, "s"), ("raw_pair_s", raw, "s"), ("raw_normal_pair_s", raw_normal, "s"),
        ("append_s", stats_of(runs, "append_s"), "s"), ("ratio", ratio, "x"),
        ("ratio_normal", ratio_normal, "x"),
        ("peak_rss_mb", stats_of(runs, "peak_rss_mb"), "MB"),
    ):  # fmt: skip
        result.metric(name, figure, unit)
    labels = {
        "pair": "ledger pair (call.sent + call.replied)",
        "single": "ledger, one append (call.sent)",
        "raw": "raw pair, synchronous=FULL",
        "raw_normal": "raw pair, synchronous=NORMAL + fdatasync",
    }
    for side, label in labels.items():
        wall = Stats.of([statistics.median(r["samples"][side]) for r in runs])
        frames = [r["frames_per_commit"][side] for r in runs if r["frames_per_commit"][side] is not None]
        fsyncs = {"pair": "ledger", "single": "ledger", "raw_normal": "raw_normal"}.get(side)
        result.rows.append({
            "side": label,
            "ms": wall.fmt(1e3, 3),
            "WAL frames per commit": f"{statistics.median(frames):.2f}" if frames else "—",
            "fdatasync per commit (counted)":
                f"{statistics.median([r['fsyncs_per_commit'][fsyncs] for r in runs]):.2f}"
                if fsyncs else "SQLite's own, at COMMIT (not counted)",
            "WAL restarts while timed": " / ".join(str(r["resets"][side]) for r in runs),
        })  # fmt: skip
    result.runs = len(runs)
    result.value = (
        f"{pair.fmt(1e3, 3, 'ms')} per pair; ratio {ratio.fmt(1, 2)} vs FULL,"
        f" {ratio_normal.fmt(1, 2)} vs NORMAL + fdatasync"
    )
    result.baseline = (
        f"{raw.fmt(1e3, 3, 'ms')} per pair of raw commits (WAL, synchronous=FULL);"
        f" {raw_normal.fmt(1e3, 3, 'ms')} with synchronous=NORMAL + fdatasync"
    )
    result.met = max(ratio.median, ratio_normal.median) <= 1.4
    order = "rotated: each iteration runs the four in the next of their 24 orders"
    result.side("raw pair, FULL", durability="WAL, synchronous=FULL (SQLite syncs the WAL at every COMMIT)",
                transport="none", order=order,
                database="its own, every WAL wrapped twice before timing")  # fmt: skip
    result.side("raw pair, NORMAL + fdatasync", durability="WAL, synchronous=NORMAL, fdatasync of the WAL"
                " after every COMMIT (the ledger's own way)", transport="none", order=order,
                database="its own, the same warm-up")  # fmt: skip
    result.side(
        "ledger pair (call.sent + call.replied)",
        durability="full, both appends durable (WAL fdatasynced after each COMMIT)",
        transport="none",
        order=order,
        database="its own (the single append has another), the same warm-up",
    )
    result.notes.append(
        f"{n} interleaved iterations per run, timed only once every side's WAL had been restarted"
        f" {WARM_RESETS} times (the 'WAL restarts while timed' column: per run); a run whose ledger and"
        " raw NORMAL sides did not both make exactly one fdatasync per commit is refused. WAL frames per"
        f" commit: the WAL-index's frame count before and after each of {FRAME_PROBES} untimed commits per"
        " side. SQLite's own syncs (FULL's at COMMIT, every side's at checkpoints) are not counted"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m quiesce.tools.bench.ledger", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--n", type=int, default=1500, help="timed iterations (after the warm-up that wraps every WAL twice)"
    )
    parser.add_argument(
        "--dir", default=None, help="folder for the temporary databases (default: system temp)"
    )
    parser.add_argument("--replay", type=int, default=0, metavar="N", help="also time replay over N events")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    folder = Path(tempfile.mkdtemp(prefix="quiesce-bench-", dir=args.dir))
    try:
        result: dict[str, Any] = anyio.run(run_once, args.n, str(folder))
        result.pop("samples")
        result["dir"] = str(folder)
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
        print(
            f"median pair of raw commits    {result['raw_normal_pair_s'] * 1e6:9.1f} us  "
            "(sqlite3, WAL, synchronous=NORMAL + fdatasync)"
        )
        print(f"ratio pair / raw pair         {result['ratio']:9.2f}    (FULL; goal <= 1.4)")
        print(f"ratio pair / raw pair         {result['ratio_normal']:9.2f}    (NORMAL + fdatasync)")
        print(f"WAL frames per commit         {result['frames_per_commit']}")
        if "replay" in result:
            r = result["replay"]
            print(
                f"replay                        {r['events']} events in {r['seconds']:.2f} s = "
                f"{r['events_per_s']:,.0f} events/s, peak RSS {r['peak_rss_mb']:.0f} MB, ok={r['ok']}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
