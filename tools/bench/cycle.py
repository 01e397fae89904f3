"""Measure #3 — a full save cycle against the 4-server reference cluster, real ledger vs null ledger.

The cluster (``tools.gymsim``, its own process, a fresh one per run): ``policy_model`` (20 ms per
model call), ``judge`` (auxiliary: never paused), ``simple_agent`` and ``tools``; 4 rollouts run
on the agent throughout, so every prepare parks running rollouts and drains the model.

One run (``run_cycles``, a fresh process): two coordinators on the same code — one on a real
SQLite ledger (WAL, the default durability "full"), one whose ledger is ``NullLedger`` (appends
nothing; its own epoch, so checkpoint ids never collide) — discover, do one warm-up cycle each, then
alternate ``CYCLES`` measured cycles each in ABBA order (a cycle's duration varies by ±20% with where the
rollouts are in their turns, so fewer make the per-run median move more than the ledger costs). A
cycle is ``Coordinator.checkpoint()``: prepare →
commit → publish (manifest, fsync, rename, ``LATEST``) → resume. The per-run medians give the
overhead ``real / null - 1``. Goal: the ledger adds <= 10%. Each side's CPU per cycle (this
process's, all threads) is reported beside it: what the ledger costs in CPU, not only in time.

A run measures ``CYCLES`` cycles per side: with 30, one run's overhead moved between about 4% and
22% (the drain a prepare waits for, the servers' fsyncs and the VM's own noise vary by several
milliseconds per cycle), which is more than what is being measured.

Before each measured cycle the rollouts run for a settle time (untimed; the same for both cycles
of a pair: 50 ms plus a random part of up to 25 ms, about one turn). A checkpoint in an RL run
comes minutes after the last one, at a random point of the rollouts' turns. Back to back, a cycle
that starts within a millisecond or two of the previous resume pauses the model before the resumed
rollouts have sent their next model call, so its prepare does not wait for a 20 ms call to drain,
while a cycle that starts a few milliseconds later does: the measure then compares where each
cycle happens to land in a turn more than what the ledger costs.
"""

from __future__ import annotations

import random
import secrets
import statistics
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, cast

import anyio
import httpx

from coordinator import Coordinator, parse_config
from coordinator.attempt import Context as CoordContext
from coordinator.calls import Caller
from coordinator.config import ClusterConfig
from coordinator.protocol import TOKEN_ENV
from ledger import Ledger
from tools.bench.harness import Context, Result, Stats, run_child, stats_of
from tools.bench.nullledger import NullLedger
from tools.gymsim import client
from tools.gymsim.cluster import ClusterProcess, spawn_cluster

SPEC: dict[str, Any] = {
    "servers": [
        {"kind": "model", "name": "policy_model", "latency_s": 0.02},
        {"kind": "model", "name": "judge", "instance_role": "auxiliary"},
        {"kind": "agent", "name": "simple_agent", "policy": "policy_model", "resources": "tools"},
        {"kind": "resources", "name": "tools", "judge": "judge"},
    ]
}


#: Measured cycles per side in one run (see the module docstring).
CYCLES = 100
#: Untimed run time of the rollouts before each measured cycle: SETTLE_S + up to SETTLE_JITTER_S.
SETTLE_S = 0.05
SETTLE_JITTER_S = 0.025


@contextmanager
def cluster(spec: dict[str, Any], token: str, work: Path) -> Iterator[ClusterProcess]:
    """A reference cluster in its own process (``spawn_cluster``), stopped on exit."""
    folder = work / f"cluster-{secrets.token_hex(4)}"
    with spawn_cluster(spec, env={TOKEN_ENV: token}, workdir=folder) as running:
        yield running


async def start_rollouts(urls: dict[str, str], agents: list[str], rollouts: int, turns: int) -> None:
    """Start ``rollouts`` long rollouts on each agent and wait until each ran a turn."""
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        for name in agents:
            await client.start_rollouts(http, urls[name], {f"r{i}": turns for i in range(rollouts)})
        for name in agents:
            await client.wait_turns(http, urls[name], 1, timeout_s=60)


@asynccontextmanager
async def open_null(config: ClusterConfig, token: str) -> AsyncIterator[Coordinator]:
    """A ``Coordinator`` on the same code whose ledger is a ``NullLedger``."""
    null = cast(Ledger, NullLedger())
    caller = Caller(null, token, epoch=null.epoch)
    try:
        yield Coordinator(CoordContext(config, null, caller, None))
    finally:
        await caller.aclose()


async def timed_cycle(coord: Coordinator) -> float:
    """Seconds of one ``Coordinator.checkpoint()`` (prepare → commit → publish → resume)."""
    start = time.perf_counter()
    await coord.checkpoint()
    return time.perf_counter() - start


async def run_cycles(config: dict[str, Any], token: str, cycles: int, dir: str) -> dict[str, Any]:
    """One run of #3: ``cycles`` measured cycles per side (after one warm-up each), ABBA order."""
    folder = Path(dir)
    real_cfg = parse_config(
        {
            **config,
            "ledger": f"sqlite+aiosqlite:///{folder / 'ledger.db'}",
            "snapshots": str(folder / "real"),
        },
        base_dir=folder,
    )
    null_cfg = parse_config({**config, "snapshots": str(folder / "null")}, base_dir=folder)
    real_s: list[float] = []
    null_s: list[float] = []
    cpu: dict[str, list[float]] = {"real": [], "null": []}
    rng = random.Random()

    async def settled_cycle(coord: Coordinator, side: str, settle_s: float) -> float:
        await anyio.sleep(settle_s)
        start = time.process_time()
        took = await timed_cycle(coord)
        cpu[side].append(time.process_time() - start)
        return took

    async with Coordinator.open(real_cfg, token=token) as real, open_null(null_cfg, token) as null:
        await real.discover()
        await null.discover()
        await timed_cycle(real)
        await timed_cycle(null)
        for i in range(cycles):
            settle_s = SETTLE_S + rng.random() * SETTLE_JITTER_S
            if i % 2 == 0:
                real_s.append(await settled_cycle(real, "real", settle_s))
                null_s.append(await settled_cycle(null, "null", settle_s))
            else:
                null_s.append(await settled_cycle(null, "null", settle_s))
                real_s.append(await settled_cycle(real, "real", settle_s))
        head = await real.ledger.head()
        events = head.seq if head is not None else 0
    real_m, null_m = statistics.median(real_s), statistics.median(null_s)
    return {
        "real_s": real_m,
        "null_s": null_m,
        "overhead": real_m / null_m - 1,
        "real_cpu_s": statistics.median(cpu["real"]),
        "null_cpu_s": statistics.median(cpu["null"]),
        "events_per_cycle": events / (cycles + 1),
    }


def measure(ctx: Context) -> Result:
    """Measure #3 (see the module docstring)."""
    cycles = 2 if ctx.quick else CYCLES
    result = Result(3, "save cycle, 4-server reference cluster: real vs null ledger", "ledger adds <= 10%")
    token = "bench-" + secrets.token_hex(8)
    runs: list[dict[str, Any]] = []
    for index in range(ctx.runs):
        with cluster(SPEC, token, ctx.work) as running:
            anyio.run(start_rollouts, running.urls, ["simple_agent"], 4, 1_000_000)
            folder = ctx.work / f"cycle-{index}"
            folder.mkdir()
            params = {"config": running.config(), "token": token, "cycles": cycles, "dir": str(folder)}
            runs.append(run_child("cycle:run_cycles", params))
        ctx.log(f"  run {index + 1}/{ctx.runs}: real {runs[-1]['real_s'] * 1e3:.1f} ms,"
                f" null {runs[-1]['null_s'] * 1e3:.1f} ms")  # fmt: skip
    real, null, overhead = stats_of(runs, "real_s"), stats_of(runs, "null_s"), stats_of(runs, "overhead")
    result.runs = len(runs)
    result.metric("real_cycle_s", real, "s")
    result.metric("null_cycle_s", null, "s")
    result.metric("overhead", overhead, "fraction")
    real_cpu, null_cpu = stats_of(runs, "real_cpu_s"), stats_of(runs, "null_cpu_s")
    result.metric("real_cpu_s", real_cpu, "s")
    result.metric("null_cpu_s", null_cpu, "s")
    result.metric("peak_rss_mb", stats_of(runs, "peak_rss_mb"), "MB")
    result.value = f"{real.fmt(1e3, 1, 'ms')} per cycle; ledger adds {overhead.fmt(100, 1, '%')}"
    result.baseline = f"{null.fmt(1e3, 1, 'ms')} per cycle with a null ledger"
    result.met = overhead.median <= 0.10
    per_cycle = Stats.of([r["events_per_cycle"] for r in runs])
    result.notes.append(
        f"{cycles} measured cycles per side per run (ABBA order, after one warm-up each); about"
        f" {per_cycle.median:.0f} ledger events per cycle; 4 rollouts running on simple_agent;"
        f" policy model 20 ms per call; before each cycle the rollouts run {SETTLE_S * 1e3:.0f}"
        f"-{(SETTLE_S + SETTLE_JITTER_S) * 1e3:.0f} ms (random, the same for both sides of a pair;"
        " untimed), so a cycle starts at a random point of the rollouts' turns"
    )
    result.notes.append(
        f"coordinator CPU per cycle (this process, all its threads): {real_cpu.fmt(1e3, 1, 'ms')} with the"
        f" real ledger, {null_cpu.fmt(1e3, 1, 'ms')} with the null ledger. On this VM a few milliseconds of"
        " idle leave the CPU cold, and each ledger step runs right after a server's reply: it costs"
        " 3-10 times what it costs in a tight loop (see the closing notes of issue 7)"
    )
    return result


__all__ = ["cluster", "measure", "open_null", "run_cycles", "start_rollouts", "timed_cycle"]
