"""Measure #4 — a save and a discovery at N = 8 … 512 distinct origins, against the floor of a bare client.

The cluster for N (``spawn_parts``): ``PROCESSES`` gymsim server processes, every server on its
own loopback port (N distinct origins: no connection is shared between two servers). One policy
model (in the first process), ``(N-1)//2`` agents and the rest resources servers (agent ``i``
uses ``tools_i``, in the same process), spread evenly; agents elsewhere call the policy model by
URL. Rollouts run throughout: ``ROLLOUTS_PER_PROCESS`` agents per process each run one endless
rollout (policy model ``MODEL_LATENCY_S`` per call, then a tool call), so every prepare parks
running rollouts and drains the model, and every commit writes real state files.

Each run gets a cluster of its own, started for it: the rollouts' state (the model's call ledger
and storage index, the agents' turn logs) grows for as long as they run and every commit writes
all of it, so a cluster kept across runs made each run slower than the last (at N=64: 1.0, 5.3,
17.8 s per save in three runs), with both sides slowed alike.

One run (``run_scale``, a fresh process) holds a coordinator on a real SQLite ledger (durability
full, ``fanout: parallel``, ``keep_latest: 1``) and a ``BareClient`` (``bareclient.py``: the same
requests in the same role-group order to the same servers, with the same HTTP client code and
nothing else). It times, interleaved (which goes first alternates):

- discovery: ``Coordinator.discover()`` vs the bare client's capabilities GETs, each on fresh
  connections (after ``SPACE_S`` of idle: beyond ``quiesce.coordinator.http.IDLE_REUSE_S``, so pooled
  connections are not reused);
- saves back to back: ``Coordinator.checkpoint()`` vs ``BareClient.save()``, reusing connections;
- saves on fresh connections: the same, each after ``SPACE_S`` of idle (an RL run's checkpoints
  are minutes apart: every one of them opens its connections anew).

Per save: wall time, this process's CPU (per participant too) and the server processes' CPU.
The run's figures are the medians of its cycles; the goal (at N=512): save / floor <= 1.5 in both
connection modes.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio

from quiesce.coordinator import Coordinator, parse_config
from quiesce.coordinator.http import IDLE_REUSE_S
from quiesce.coordinator.protocol import AGENT, MODEL, RESOURCES, TOKEN_ENV
from quiesce.tools.bench.bareclient import BareClient
from quiesce.tools.bench.cycle import start_rollouts
from quiesce.tools.bench.harness import Context, Result, Stats, process_cpu_s, run_child, stats_of
from quiesce.tools.gymsim.cluster import ClusterProcess, spawn_cluster

SIZES = (8, 64, 256, 512)
QUICK_SIZES = (8,)
PROCESSES = 4
ROLLOUTS_PER_PROCESS = 4
MODEL_LATENCY_S = 0.1
#: Idle time before a "fresh connections" cycle: beyond the client's reuse window.
SPACE_S = IDLE_REUSE_S + 0.5


def spec_parts(n: int, processes: int = PROCESSES, policy_url: str | None = None) -> list[dict[str, Any]]:
    """The gymsim specs of N participants over ``processes`` processes, every server on its own port.

    The first part holds the policy model; the others need ``policy_url`` (its URL), since a
    server resolves peer names only within its own process.
    """
    agents = (n - 1) // 2
    resources = n - 1 - agents
    if agents < 2 or resources < agents:
        raise ValueError("N must be at least 5")
    parts: list[dict[str, Any]] = [{"servers": []} for _ in range(processes)]
    parts[0]["servers"].append({"kind": "model", "name": "policy_model", "latency_s": MODEL_LATENCY_S})
    for i in range(resources):
        part = parts[i % processes]["servers"]
        if i < agents:
            policy = "policy_model" if i % processes == 0 else policy_url
            part.append({"kind": "agent", "name": f"agent_{i}", "policy": policy, "resources": f"tools_{i}"})
        part.append({"kind": "resources", "name": f"tools_{i}"})
    return [p for p in parts if p["servers"]]


def spec_for(n: int) -> dict[str, Any]:
    """N participants in one gymsim process under path prefixes on one port (measure #6 and the
    corpus of ``history.py``, not #4): 1 policy model, (N-1)//2 agents, the rest resources."""
    agents = (n - 1) // 2
    resources = n - 1 - agents
    if agents < 2:
        raise ValueError("N must be at least 5")
    return {
        "servers": [
            {"kind": "model", "name": "policy_model", "prefix": True},
            {"kind": "agent", "name": "agent_{i}", "count": agents, "prefix": True,
             "policy": "policy_model", "resources": "tools_{i}"},
            {"kind": "resources", "name": "tools_{i}", "count": resources, "prefix": True},
        ]
    }  # fmt: skip


def members_of(urls: dict[str, str]) -> list[tuple[str, str, str]]:
    """(name, component, url) of every participant, from the names ``spec_parts`` gives."""
    out = []
    for name, url in urls.items():
        component = MODEL if name == "policy_model" else AGENT if name.startswith("agent_") else RESOURCES
        out.append((name, component, url))
    return out


@contextlib.contextmanager
def spawn_parts(
    n: int, token: str, work: Path, processes: int = PROCESSES
) -> Iterator[tuple[dict[str, str], list[int]]]:
    """The N-participant cluster (see the module docstring): (urls, server process pids)."""
    folder = work / f"scale-{n}-{secrets.token_hex(3)}"
    with contextlib.ExitStack() as stack:
        first = spec_parts(n, processes)[0]
        running: list[ClusterProcess] = [
            stack.enter_context(spawn_cluster(first, env={TOKEN_ENV: token}, workdir=folder / "p0"))
        ]
        policy_url = running[0].urls["policy_model"]
        for index, part in enumerate(spec_parts(n, processes, policy_url)[1:], start=1):
            running.append(
                stack.enter_context(spawn_cluster(part, env={TOKEN_ENV: token}, workdir=folder / f"p{index}"))
            )
        urls = {name: url for process in running for name, url in process.urls.items()}
        yield urls, [process.pid for process in running]


def _servers_cpu_s(pids: list[int]) -> float:
    return sum(process_cpu_s(pid) for pid in pids)


async def run_scale(
    urls: dict[str, str], token: str, cycles: int, dir: str, pids: list[int], first: str
) -> dict[str, Any]:
    """One run of #4 (see the module docstring); ``first`` ("save" or "floor") goes first in a pair."""
    folder = Path(dir)
    members = members_of(urls)
    config = parse_config(
        {
            "ledger": f"sqlite+aiosqlite:///{folder / 'ledger.db'}",
            "snapshots": str(folder / "snapshots"),
            "fanout": "parallel",
            "keep_latest": 1,
            "deadline_s": 120,
            "servers": [{"name": name, "url": url} for name, _, url in members],
        },
        base_dir=folder,
    )
    bare = BareClient(members, token, folder / "bare-snapshots")
    took: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    servers_cpu: dict[str, list[float]] = {}

    async def timed(key: str, action: Callable[[], Awaitable[Any]]) -> None:
        wall, mine, theirs = time.perf_counter(), time.process_time(), _servers_cpu_s(pids)
        await action()
        took.setdefault(key, []).append(time.perf_counter() - wall)
        cpu.setdefault(key, []).append(time.process_time() - mine)
        servers_cpu.setdefault(key, []).append(_servers_cpu_s(pids) - theirs)

    order = ("save", "floor") if first == "save" else ("floor", "save")
    try:
        async with Coordinator.open(config, token=token) as coord:
            discovered = await coord.discover()
            actions: dict[str, Callable[[], Awaitable[Any]]] = {
                "discover": coord.discover,
                "bare_discover": lambda: bare.discover([url for _, _, url in members]),
                "save": coord.checkpoint,
                "floor": bare.save,
            }
            # warm-up: one of each
            await actions["bare_discover"]()
            await coord.checkpoint()
            await bare.save()
            for _ in range(cycles):  # discovery on fresh connections
                for side in (
                    ("discover", "bare_discover") if first == "save" else ("bare_discover", "discover")
                ):
                    await anyio.sleep(SPACE_S)
                    await timed(f"fresh_{side}", actions[side])
            for _ in range(cycles):  # saves back to back, connections reused
                for side in order:
                    await timed(f"reuse_{side}", actions[side])
            for _ in range(cycles):  # saves on fresh connections
                for side in order:
                    await anyio.sleep(SPACE_S)
                    await timed(f"fresh_{side}", actions[side])
    finally:
        await bare.aclose()
    out: dict[str, Any] = {"participants": len(discovered.participants)}
    for key, values in took.items():
        out[f"{key}_s"] = statistics.median(values)
        out[f"{key}_cpu_s"] = statistics.median(cpu[key])
        out[f"{key}_servers_cpu_s"] = statistics.median(servers_cpu[key])
    for mode in ("reuse", "fresh"):
        out[f"{mode}_ratio"] = out[f"{mode}_save_s"] / out[f"{mode}_floor_s"]
    out["discover_ratio"] = out["fresh_discover_s"] / out["fresh_bare_discover_s"]
    return out


def measure(ctx: Context) -> Result:
    """Measure #4 (see the module docstring)."""
    sizes = ctx.sizes or (QUICK_SIZES if ctx.quick else SIZES)
    cycles = 1 if ctx.quick else 3
    largest = sizes[-1]
    result = Result(
        4,
        f"save and discovery at N distinct origins over {PROCESSES} server processes, rollouts running",
        "save at N=512 <= 1.5x a bare client's same requests, reusing connections and on fresh ones",
    )
    token = "bench-" + secrets.token_hex(8)
    table: dict[int, list[dict[str, Any]]] = {}
    for n in sizes:
        for index in range(ctx.runs):  # a fresh cluster per run: see "Each run" in the docstring
            with spawn_parts(n, token, ctx.work, 2 if ctx.quick else PROCESSES) as (urls, pids):
                agents = [name for name in urls if name.startswith("agent_")]
                with_rollouts = [a for i, a in enumerate(agents) if i // PROCESSES < ROLLOUTS_PER_PROCESS]
                anyio.run(start_rollouts, urls, with_rollouts, 1, 1_000_000)
                folder = ctx.work / f"scale-{n}-run-{index}"
                folder.mkdir()
                params = {"urls": urls, "token": token, "cycles": cycles, "dir": str(folder), "pids": pids,
                          "first": "save" if index % 2 == 0 else "floor"}  # fmt: skip
                run = run_child("scale:run_scale", params, timeout_s=1800)
                table.setdefault(n, []).append(run)
                ctx.log(f"  N={n} run {index + 1}/{ctx.runs}: save {run['reuse_save_s']:.2f} s reusing"
                        f" ({run['reuse_ratio']:.2f}x the floor), {run['fresh_save_s']:.2f} s fresh"
                        f" ({run['fresh_ratio']:.2f}x); discovery {run['fresh_discover_s']:.2f} s"
                        f" ({run['discover_ratio']:.2f}x)")  # fmt: skip
    rows = []
    previous: tuple[int, float] | None = None
    for n in sizes:
        runs = table[n]
        participants = int(runs[0]["participants"])
        for mode, label in (("reuse", "back to back, reused"), ("fresh", "fresh connections")):
            save, floor = stats_of(runs, f"{mode}_save_s"), stats_of(runs, f"{mode}_floor_s")
            ratio = stats_of(runs, f"{mode}_ratio")
            save_cpu = stats_of(runs, f"{mode}_save_cpu_s")
            slope = ""
            if mode == "fresh" and previous is not None:
                n0, t0 = previous
                slope = f"{math.log(save.median / t0) / math.log(participants / n0):.2f}"
            if mode == "fresh":
                previous = (participants, save.median)
            rows.append({
                "N": participants,
                "connections": label,
                "save (s)": save.fmt(1, 3),
                "floor: bare client (s)": floor.fmt(1, 3),
                "save / floor": ratio.fmt(1, 2),
                "coordinator CPU per save (s)": save_cpu.fmt(1, 3),
                "coordinator CPU per participant (ms)": f"{save_cpu.median / participants * 1e3:.2f}",
                "bare client CPU per save (s)": stats_of(runs, f"{mode}_floor_cpu_s").fmt(1, 3),
                "server processes' CPU per save (s)": stats_of(runs, f"{mode}_save_servers_cpu_s").fmt(1, 3),
                "log-log slope vs previous N": slope,
            })  # fmt: skip
            result.metric(f"{mode}_save_s_{participants}", save, "s")
            result.metric(f"{mode}_floor_s_{participants}", floor, "s")
            result.metric(f"{mode}_ratio_{participants}", ratio, "x")
            result.metric(f"{mode}_save_cpu_s_{participants}", save_cpu, "s")
        discover, bare_discover = stats_of(runs, "fresh_discover_s"), stats_of(runs, "fresh_bare_discover_s")
        rows.append({
            "N": participants,
            "connections": "discovery, fresh connections",
            "save (s)": discover.fmt(1, 3),
            "floor: bare client (s)": bare_discover.fmt(1, 3),
            "save / floor": stats_of(runs, "discover_ratio").fmt(1, 2),
            "coordinator CPU per save (s)": stats_of(runs, "fresh_discover_cpu_s").fmt(1, 3),
            "coordinator CPU per participant (ms)":
                f"{stats_of(runs, 'fresh_discover_cpu_s').median / participants * 1e3:.2f}",
            "bare client CPU per save (s)": stats_of(runs, "fresh_bare_discover_cpu_s").fmt(1, 3),
            "server processes' CPU per save (s)": stats_of(runs, "fresh_discover_servers_cpu_s").fmt(1, 3),
            "log-log slope vs previous N": "",
        })  # fmt: skip
        result.metric(f"discover_s_{participants}", discover, "s")
        result.metric(f"bare_discover_s_{participants}", bare_discover, "s")
    top = table[largest]
    participants = int(top[0]["participants"])
    reuse, fresh = stats_of(top, "reuse_ratio"), stats_of(top, "fresh_ratio")
    reuse_save, fresh_save = stats_of(top, "reuse_save_s"), stats_of(top, "fresh_save_s")
    everything = [r for runs in table.values() for r in runs]
    result.metric("peak_rss_mb", Stats.of([r["peak_rss_mb"] for r in everything]), "MB")
    result.runs = ctx.runs
    result.rows = rows
    cpu = stats_of(top, "fresh_save_cpu_s")
    result.value = (
        f"N={participants}: save {reuse_save.fmt(1, 2, 's')} reusing connections = {reuse.fmt(1, 2)}x the"
        f" floor; {fresh_save.fmt(1, 2, 's')} on fresh ones = {fresh.fmt(1, 2)}x; coordinator CPU"
        f" {cpu.median / participants * 1e3:.2f} ms per participant; discovery"
        f" {stats_of(top, 'fresh_discover_s').fmt(1, 2, 's')}"
    )
    result.baseline = (
        f"bare client, same requests, same run: {stats_of(top, 'reuse_floor_s').fmt(1, 2, 's')} reusing,"
        f" {stats_of(top, 'fresh_floor_s').fmt(1, 2, 's')} fresh;"
        f" discovery {stats_of(top, 'fresh_bare_discover_s').fmt(1, 2, 's')}"
    )
    result.met = max(reuse.median, fresh.median) <= 1.5 if participants == 512 else None
    if participants != 512:
        result.notes.append("N=512 not run: the goal is not judged")
    result.side("coordinator", durability="full (real SQLite ledger)", transport="loopback HTTP,"
                " coordinator/http.py, one origin per server", order="alternating with the floor, first side"
                " alternating per run", fanout="parallel")  # fmt: skip
    result.side("floor: bare client (tools/bench/bareclient.py)", durability="none (no ledger, no manifest,"
                " no fsync)", transport="the same client code and servers", order="the same",
                fanout="parallel")  # fmt: skip
    result.notes.append(
        f"{cycles} timed cycles per side, mode and run after one warm-up each; {PROCESSES} gymsim processes,"
        f" every server on its own port; {ROLLOUTS_PER_PROCESS} agents per process run an endless rollout"
        f" (policy model {MODEL_LATENCY_S * 1e3:.0f} ms per call, then a tool call); 'fresh' cycles start"
        f" after {SPACE_S:.1f} s of idle (the client reuses a pooled connection for {IDLE_REUSE_S} s); the"
        " server processes share the machine's 2 cores with the coordinator"
    )
    return result
