"""Measure #7 — the ledger on PostgreSQL: a recorded call vs raw asyncpg, a 4-server save vs a null
ledger, and the lease renewal.

A throwaway PostgreSQL cluster (``quiesce.tools.pgtemp.TempPostgres``, ``fsync`` on, the server's default
``synchronous_commit = on``) on the same machine, a new database per run:

- **calls** (``run_calls``, a fresh process per run): interleaved, in a rotating order, a pair of
  raw asyncpg statements (an ``INSERT`` of an events-like row into a table with the ledger's
  columns and indexes, twice, each its own transaction: the cheapest durable insert asyncpg
  offers — one autocommit statement, one round trip; BEGIN and COMMIT around it would add two),
  a recorded call's
  two durable appends on the ledger (``call.sent`` + ``call.replied``), and a lease renewal
  (``Ledger.renew_lease``: one ``UPDATE`` of the lease row, in its own transaction). Goal: the
  appends take <= 1.5x the raw pair. Beside the times, the benchmark process's CPU per pair on
  each side: that part of the difference is the client's (validation, JSON, the chain, the
  projection fold), the rest the server's (the insert-at-head trigger, the ``attempts`` upsert).
- **save** (``cycle.run_cycles`` with a PostgreSQL ledger, a fresh process per run): the 4-server
  reference cluster with rollouts running, real ledger vs ``NullLedger`` (and the bare SQLite log),
  as measure #3. Goal: the ledger adds <= 15%.

When no PostgreSQL binaries are found the measure is ``unavailable``.
"""

from __future__ import annotations

import itertools
import os
import secrets
import statistics
import time
from typing import Any

import anyio

from quiesce.ledger import LeaseTerms, Ledger
from quiesce.ledger.layout import MARKER_WHERE_POSTGRESQL
from quiesce.tools.bench.cycle import SPEC, cluster, interval_text, pooled_difference, start_rollouts
from quiesce.tools.bench.harness import Context, Result, run_child, stats_of
from quiesce.tools.bench.ledger import REPLIED, SENT, recorded_call
from quiesce.tools.pgtemp import PostgresUnavailable, TempPostgres

_RAW_DDL = (
    "CREATE TABLE raw_events (seq BIGINT PRIMARY KEY, at VARCHAR(32) NOT NULL, kind VARCHAR(64) NOT NULL,"
    " checkpoint_id VARCHAR(128), server VARCHAR(256), call_id VARCHAR(128), epoch BIGINT NOT NULL,"
    " data TEXT NOT NULL, prev_hash VARCHAR(64) NOT NULL, hash VARCHAR(64) NOT NULL)",
    "CREATE INDEX ix_raw_checkpoint_id ON raw_events (checkpoint_id, seq)",
    f"CREATE INDEX ix_raw_marker ON raw_events (kind, seq) WHERE {MARKER_WHERE_POSTGRESQL}",
)
_RAW_INSERT = "INSERT INTO raw_events VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"
CYCLES = 60


async def run_calls(url: str, n: int) -> dict[str, Any]:
    """``n`` rounds (after 10% warm-up) of a raw pair, a ledger pair and a lease renewal, rotating."""
    import json

    import asyncpg

    raw = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    for ddl in _RAW_DDL:
        await raw.execute(ddl)
    sent_text, replied_text = json.dumps(SENT, sort_keys=True), json.dumps(REPLIED, sort_keys=True)
    seq = itertools.count(1)
    lease = LeaseTerms(holder=f"bench-{os.getpid()}-{secrets.token_hex(4)}", ttl_s=10.0)
    took: dict[str, list[float]] = {"raw": [], "pair": [], "renew": []}
    cpu: dict[str, list[float]] = {"raw": [], "pair": [], "renew": []}
    try:
        async with Ledger.open(url, secrets=["s3cr3t-token"], lease=lease) as ledger:
            await ledger.start_epoch(
                {"coordinator": {"host": "bench", "pid": os.getpid(), "uuid": "u"}, "version": "b"}
            )
            await ledger.append(
                "attempt.started",
                checkpoint_id="ckpt-e1-0001",
                data={
                    "kind": "save",
                    "deadline_ts": 1760000000.25,
                    "participants": ["policy_model", "agent"],
                },
            )

            async def raw_pair(i: int) -> None:
                for kind, text in (("call.sent", sent_text), ("call.replied", replied_text)):
                    # autocommit: the statement is its own transaction, committed when it returns
                    await raw.execute(
                        _RAW_INSERT,
                        next(seq),
                        "2025-01-01T00:00:00.000000Z",
                        kind,
                        "ckpt-e1-0001",
                        "agent",
                        f"c{i}",
                        1,
                        text,
                        "0" * 64,
                        "f" * 64,
                    )

            async def pair(i: int) -> None:
                await recorded_call(ledger, f"p{i}")

            async def renew(i: int) -> None:
                if not await ledger.renew_lease():
                    raise RuntimeError("the lease was lost during the bench")

            sides = {"raw": raw_pair, "pair": pair, "renew": renew}
            orders = list(itertools.permutations(sides))
            warm = max(1, n // 10)
            for i in range(n + warm):
                for name in orders[i % len(orders)]:
                    start, start_cpu = time.perf_counter(), time.process_time()
                    await sides[name](i)
                    elapsed = time.perf_counter() - start
                    if i >= warm:
                        took[name].append(elapsed)
                        cpu[name].append(time.process_time() - start_cpu)
    finally:
        await raw.close()
    medians = {name: statistics.median(values) for name, values in took.items()}
    return {
        "raw_pair_s": medians["raw"],
        "append_pair_s": medians["pair"],
        "renew_s": medians["renew"],
        "ratio": medians["pair"] / medians["raw"],
        # this process's CPU (the client side: the database server's work is not in it), mean
        "append_pair_cpu_s": statistics.fmean(cpu["pair"]),
        "raw_pair_cpu_s": statistics.fmean(cpu["raw"]),
    }


def measure(ctx: Context) -> Result:
    """Measure #7 (see the module docstring)."""
    result = Result(
        7,
        "PostgreSQL: recorded call vs raw asyncpg; 4-server save, real vs null ledger; lease renewal",
        "recorded call <= 1.5x raw autocommit insert (x2); ledger adds <= 15% to a save",
    )
    try:
        pg = TempPostgres().start()  # its own temp folder: the server runs as another OS user
    except PostgresUnavailable as error:
        result.status, result.reason = "unavailable", f"no PostgreSQL here: {error}"
        return result
    n = 30 if ctx.quick else 300
    cycles = 2 if ctx.quick else CYCLES
    token = "bench-" + secrets.token_hex(8)
    calls: list[dict[str, Any]] = []
    saves: list[dict[str, Any]] = []
    try:
        for index in range(ctx.runs):
            url = pg.create_database(f"calls_{index}")
            calls.append(run_child("postgres:run_calls", {"url": url, "n": n}))
            with cluster(SPEC, token, ctx.work) as running:
                anyio.run(start_rollouts, running.urls, ["simple_agent"], 4, 1_000_000)
                folder = ctx.work / f"pg-cycle-{index}"
                folder.mkdir()
                params = {
                    "config": running.config(),
                    "token": token,
                    "cycles": cycles,
                    "dir": str(folder),
                    "ledger_url": pg.create_database(f"cycle_{index}"),
                }
                saves.append(run_child("cycle:run_cycles", params))
            ctx.log(
                f"  run {index + 1}/{ctx.runs}: pair {calls[-1]['append_pair_s'] * 1e3:.2f} ms"
                f" ({calls[-1]['ratio']:.2f}x raw), renew {calls[-1]['renew_s'] * 1e3:.2f} ms;"
                f" save adds {saves[-1]['overhead'] * 100:.1f}%"
            )
    finally:
        pg.stop()
    pair, raw, ratio = (
        stats_of(calls, "append_pair_s"),
        stats_of(calls, "raw_pair_s"),
        stats_of(calls, "ratio"),
    )
    renew = stats_of(calls, "renew_s")
    real, null, overhead = stats_of(saves, "real_s"), stats_of(saves, "null_s"), stats_of(saves, "overhead")
    added, real_cpu = stats_of(saves, "added_s"), stats_of(saves, "real_cpu_s")
    pooled = pooled_difference(saves, "real")
    for name, figure, unit in (
        ("append_pair_s", pair, "s"),
        ("raw_pair_s", raw, "s"),
        ("ratio", ratio, "x"),
        ("renew_s", renew, "s"),
        ("append_pair_cpu_s", stats_of(calls, "append_pair_cpu_s"), "s"),
        ("raw_pair_cpu_s", stats_of(calls, "raw_pair_cpu_s"), "s"),
        ("real_cycle_s", real, "s"),
        ("null_cycle_s", null, "s"),
        ("overhead", overhead, "fraction"),
        ("added_s", added, "s"),
        ("added_pooled_s", pooled, "s (median difference [95% bootstrap interval])"),
        ("real_cpu_s", real_cpu, "s"),
    ):
        result.metric(name, figure, unit)
    result.metric("peak_rss_mb", stats_of(calls + saves, "peak_rss_mb"), "MB")
    result.runs = len(calls)
    result.value = (
        f"recorded call {pair.fmt(1e3, 2, 'ms')} = {ratio.fmt(1, 2)}x raw; save {real.fmt(1e3, 1, 'ms')},"
        f" the ledger adds {overhead.fmt(100, 1, '%')} ({added.fmt(1e3, 1, 'ms')}; runs pooled:"
        f" {interval_text(pooled)}); lease renewal"
        f" {renew.fmt(1e3, 2, 'ms')}"
    )
    result.baseline = (
        f"raw asyncpg autocommit insert, twice: {raw.fmt(1e3, 2, 'ms')}; save with a null ledger"
        f" {null.fmt(1e3, 1, 'ms')}"
    )
    result.met = ratio.median <= 1.5 and overhead.median <= 0.15
    result.side(
        "raw asyncpg",
        durability="synchronous_commit on, fsync on (a commit waits for the WAL flush)",
        transport="asyncpg over loopback TCP; each insert one autocommit statement (one round trip)",
        order="rotated with the ledger pair and the renewal",
    )
    result.side(
        "ledger on PostgreSQL",
        durability="full: both appends durable (synchronous commit)",
        transport="asyncpg over loopback TCP (the writer session's own connection); each append one"
        " statement in its own transaction (one round trip)",
        order="the same",
    )
    result.side(
        "save: real vs null ledger",
        durability="full (PostgreSQL) vs none",
        transport="loopback HTTP to the 4-server cluster",
        order="rotated per round, as #3",
    )
    result.notes.append(
        f"{n} rounds per run (after 10% warm-up); saves: {cycles} per side per run, as measure #3; the"
        " lease is renewed every lease_s/3 (3.3 s by default), so renewing costs a coordinator"
        f" about {renew.median / 3.33 * 100:.3f}% of its time"
    )
    pair_cpu, raw_cpu = stats_of(calls, "append_pair_cpu_s"), stats_of(calls, "raw_pair_cpu_s")
    result.notes.append(
        f"client CPU per recorded call {pair_cpu.fmt(1e3, 3, 'ms')} vs {raw_cpu.fmt(1e3, 3, 'ms')} for the"
        " raw pair (mean process CPU of the benchmark process; the database server's work is not in it):"
        " the rest of the difference is the server's (the insert-at-head trigger, the attempts upsert)"
    )
    return result
