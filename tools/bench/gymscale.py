"""Measure #11 — a save on Gym's unified plane (v2) by quiesce vs by Gym's own stateless coordination,
at N = 8, 64, 512 distinct origins, episodes running.

The cluster for N (``spawn_parts``): ``PROCESSES`` gymsim processes of v2 servers, every server on its
own loopback port. One policy model (first process); the rest in chains — environment ``env_i``
whose turns call ``agent_i``, which calls the policy model (by URL from the other processes) and
``tools_i`` — spread evenly, a chain in one process; leftover resources servers idle. The first
``EPISODE_ENVS_PER_PROCESS`` environments of each process run one endless episode each
(``episodes.running_episodes``; policy model ``MODEL_LATENCY_S`` per call), so every prepare waits
for episodes to reach a boundary and every commit writes real records. A fresh cluster per run.

One run (``run_gymscale``, a fresh process) holds both sides over the same servers:

- quiesce: ``Coordinator.checkpoint(episodes=scope)`` on a real SQLite ledger (durability full;
  ``keep_latest`` beyond the run's saves: ``KEEP``);
- Gym: ``GymCoordination.save(scope)`` (``gymcoord.py``: Gym's calls in Gym's order, no ledger).

Both: the same scope (every running episode), the same 120 s deadline, the same HTTP client code
(``coordinator/http.py``; quiesce's given to ``Coordinator.open(client=...)``), one client per side
(``ModeClient``) in two connection modes — ``reuse`` (pooled; a connection is reused for up to
``REUSE_IDLE_S``) and ``fresh`` (one new connection per call) — with saves in pairs, which side
goes first alternating, each save after the same settle time (the episodes run a random part of
a turn, untimed). One untimed pair first reads every server's control log to check that both
sides sent the same control calls (``same_calls``). After each timed quiesce save the bench
waits (untimed) until its ledger's WAL upkeep (a background fsync and checkpoint,
``quiesce.ledger.sqlite_upkeep``) is done, so it never runs in Gym's timed window.
Goal (N=512): quiesce / Gym ≤ 1.2 in both modes.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx

from quiesce.coordinator import ClusterConfig, Coordinator, parse_config
from quiesce.coordinator.http import HttpClient, _Connection, _Origin
from quiesce.coordinator.protocol import TOKEN_ENV
from quiesce.coordinator.protocol_v2 import EpisodeId
from quiesce.tools.bench.episodes import running_episodes
from quiesce.tools.bench.gymcoord import GymCoordination
from quiesce.tools.bench.harness import (
    Context,
    Result,
    Stats,
    process_cpu_s,
    run_child,
    stats_of,
    upkeep_settled,
)
from quiesce.tools.gymsim.cluster import ClusterProcess, spawn_cluster

SIZES = (8, 64, 512)
QUICK_SIZES = (8,)
PROCESSES = 4
EPISODE_ENVS_PER_PROCESS = 4
MODEL_LATENCY_S = 0.1
DEADLINE_S = 120.0
CYCLES = 5
#: Untimed run time of the episodes before each save: SETTLE_S + up to one turn (the same for both
#: saves of a pair).
SETTLE_S = 0.05
#: quiesce's ``keep_latest``: more snapshots than a run publishes, so neither side deletes one (the
#: Gym side deletes nothing): deleting a 512-server checkpoint takes seconds on this disk, the same
#: on both sides, and would hide what the coordinators themselves cost.
KEEP = 10_000
MODES = ("reuse", "fresh")
SIDES = ("quiesce", "gym")
#: ``reuse`` mode: how long an idle pooled connection is reused. The client's own limit
#: (``IDLE_REUSE_S``, 1.5 s) is shorter than a pair of 512-server saves, so with it each side's pool
#: emptied whenever the other side's save ran between two of its own — in alternate pairs, a
#: different side each time — and "reuse" measured a mix of reused and fresh connections (seen:
#: 512 connects in every other save of each side). Kept under uvicorn's 5 s keep-alive, so no
#: server closes a connection the pool still offers.
REUSE_IDLE_S = 4.0


class ModeClient(HttpClient):
    """The coordinator's HTTP client in one of the two connection modes: ``reuse`` (its pool, as
    ``HttpClient``, but reusing a connection idle for up to ``REUSE_IDLE_S``) or ``fresh`` — no
    pool: every call opens (and then closes) its own connection. Each side holds one for the whole
    run (quiesce's given to ``Coordinator.open(client=...)``); ``use(mode)`` switches it between
    saves; ``connects`` counts the connections it opened, so a run shows what each mode did.
    Bench-only: it replaces the pool lookup, a private step of ``HttpClient``."""

    idle_reuse_s = REUSE_IDLE_S

    def __init__(self, mode: str = "fresh") -> None:
        super().__init__()
        self.fresh = mode == "fresh"
        self.connects = 0

    async def _connect(self, origin: _Origin, timeout_s: float) -> _Connection:
        self.connects += 1
        return await super()._connect(origin, timeout_s)

    def use(self, mode: str) -> None:
        """Switch to ``mode``. To ``fresh``: the idle pooled connections are closed now (outside a
        timed save); to ``reuse``: the pool is kept, so the first timed save reuses what the
        untimed saves before it opened."""
        self.fresh = mode == "fresh"
        if not self.fresh:
            return
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
                self._all.discard(conn)
        self._idle.clear()

    def _take_idle(self, key: tuple[str, str, int], now: float) -> _Connection | None:
        if not self.fresh:
            return super()._take_idle(key, now)
        for conn in self._idle.pop(key, []):
            conn.close()
            self._all.discard(conn)
        return None


def spec_parts(n: int, processes: int = PROCESSES, policy_url: str | None = None) -> list[dict[str, Any]]:
    """The v2 gymsim specs of N participants over ``processes`` processes (module docstring); the
    parts after the first need ``policy_url``, the policy model's URL."""
    chains = (n - 1) // 3
    if chains < 1:
        raise ValueError("N must be at least 4")
    extra = n - 1 - 3 * chains
    parts: list[list[dict[str, Any]]] = [[] for _ in range(processes)]
    parts[0].append({"kind": "model", "plane": "v2", "name": "policy_model", "latency_s": MODEL_LATENCY_S})
    for i in range(chains + extra):
        part = parts[i % processes]
        if i < chains:
            policy = "policy_model" if i % processes == 0 else policy_url
            part += [
                {"kind": "environment", "plane": "v2", "name": f"env_{i}", "agent": f"agent_{i}"},
                {"kind": "agent", "plane": "v2", "name": f"agent_{i}", "policy": policy,
                 "resources": f"tools_{i}"},
            ]  # fmt: skip
        part.append({"kind": "resources", "plane": "v2", "name": f"tools_{i}"})
    return [{"servers": servers} for servers in parts if servers]


def episode_envs(urls: dict[str, str], processes: int = PROCESSES) -> dict[str, str]:
    """The environments that run an episode: the first ``EPISODE_ENVS_PER_PROCESS`` of each process."""
    chosen = {}
    for name, url in urls.items():
        if name.startswith("env_") and int(name[4:]) // processes < EPISODE_ENVS_PER_PROCESS:
            chosen[name] = url
    return chosen


@contextlib.contextmanager
def spawn_parts(
    n: int, token: str, work: Path, processes: int = PROCESSES
) -> Iterator[tuple[dict[str, str], list[int]]]:
    """The N-participant v2 cluster: (urls, server process pids)."""
    folder = work / f"gymscale-{n}-{secrets.token_hex(3)}"
    with contextlib.ExitStack() as stack:
        env = {TOKEN_ENV: token}
        first = spec_parts(n, processes)[0]
        running: list[ClusterProcess] = [
            stack.enter_context(spawn_cluster(first, env=env, workdir=folder / "p0"))
        ]
        policy_url = running[0].urls["policy_model"]
        for index, part in enumerate(spec_parts(n, processes, policy_url)[1:], start=1):
            running.append(stack.enter_context(spawn_cluster(part, env=env, workdir=folder / f"p{index}")))
        yield {name: url for p in running for name, url in p.urls.items()}, [p.pid for p in running]


async def control_logs(urls: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    """Every server's control log (``/gymsim/admin/control-log``: method, path, checkpoint id)."""
    out: dict[str, list[dict[str, Any]]] = {}
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:

        async def one(name: str) -> None:
            reply = await http.get(urls[name] + "/gymsim/admin/control-log")
            reply.raise_for_status()
            out[name] = reply.json()

        async with anyio.create_task_group() as tg:
            for name in urls:
                tg.start_soon(one, name)
    return out


def calls_between(
    before: dict[str, list[dict[str, Any]]], after: dict[str, list[dict[str, Any]]]
) -> Counter[tuple[str, str, str]]:
    """(server, method, route) of every control call logged between two reads, counted."""
    return Counter(
        (name, entry["method"], entry["path"].rsplit("/", 1)[-1])
        for name, entries in after.items()
        for entry in entries[len(before.get(name, [])) :]
    )


def quiesce_config(urls: dict[str, str], folder: Path) -> ClusterConfig:
    """quiesce's side: a real SQLite ledger in ``folder`` (durability full), fanout parallel, the
    run's deadline, every server; retention beyond the run's saves (``KEEP``: nothing deleted)."""
    return parse_config(
        {
            "ledger": f"sqlite+aiosqlite:///{folder / 'ledger.db'}",
            "snapshots": str(folder / "snapshots"),
            "fanout": "parallel",
            "keep_latest": KEEP,
            "deadline_s": DEADLINE_S,
            "servers": [{"name": name, "url": url} for name, url in urls.items()],
        },
        base_dir=folder,
    )


async def run_gymscale(
    urls: dict[str, str], token: str, cycles: int, dir: str, pids: list[int], first: str,
    scope: list[dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """One run of #11 (module docstring); ``first`` ("quiesce" or "gym") goes first in the first pair."""
    folder = Path(dir)
    config = quiesce_config(urls, folder)
    episodes = [EpisodeId.model_validate(e) for e in scope]
    clients = {side: ModeClient("reuse") for side in SIDES}  # one per side, switched per mode
    took: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    servers_cpu: dict[str, list[float]] = {}
    connects: dict[str, list[int]] = {}
    rng = random.Random()

    def servers_cpu_s() -> float:
        return sum(process_cpu_s(pid) for pid in pids)

    async def timed(key: str, action: Callable[[], Awaitable[Any]]) -> None:
        client = clients[key.rsplit("_", 1)[1]]
        opened = client.connects
        wall, mine, theirs = time.perf_counter(), time.process_time(), servers_cpu_s()
        await action()
        took.setdefault(key, []).append(time.perf_counter() - wall)
        connects.setdefault(key, []).append(client.connects - opened)
        cpu.setdefault(key, []).append(time.process_time() - mine)
        servers_cpu.setdefault(key, []).append(servers_cpu_s() - theirs)

    out: dict[str, Any] = {}
    try:
        async with Coordinator.open(config, token=token, client=clients["quiesce"]) as coord:
            gym = GymCoordination(urls, token, folder / "gym-snapshots", clients["gym"])
            logs = [await control_logs(urls)]
            discovered = await coord.discover()
            logs.append(await control_logs(urls))
            await gym.discover()
            logs.append(await control_logs(urls))
            out["discover_calls_quiesce"] = sum(calls_between(logs[0], logs[1]).values())
            out["discover_calls_gym"] = sum(calls_between(logs[1], logs[2]).values())
            actions: dict[str, Callable[[], Awaitable[Any]]] = {
                "quiesce": lambda: coord.checkpoint(episodes=episodes),
                "gym": lambda: gym.save(scope, deadline_s=DEADLINE_S),
            }
            for side in SIDES:  # warm-up
                await actions[side]()
            # the same control calls on both sides: one untimed pair, read from the servers' logs
            logs = [await control_logs(urls)]
            for side in SIDES:
                await actions[side]()
                logs.append(await control_logs(urls))
            sent = {side: calls_between(logs[i], logs[i + 1]) for i, side in enumerate(SIDES)}
            out["calls_quiesce"] = sum(sent["quiesce"].values())
            out["calls_gym"] = sum(sent["gym"].values())
            out["same_calls"] = sent["quiesce"] == sent["gym"]
            differ = (sent["quiesce"] - sent["gym"]) + (sent["gym"] - sent["quiesce"])
            out["calls_differ"] = sorted(" ".join(k) for k in differ)[:10]
            for mode in MODES:
                for client in clients.values():
                    client.use(mode)
                if mode == "reuse":  # an untimed pair: the pools hold a live connection to every server
                    for side in SIDES:
                        await actions[side]()
                for index in range(cycles):
                    settle_s = SETTLE_S + rng.random() * MODEL_LATENCY_S
                    order = SIDES if (index + (first == "gym")) % 2 == 0 else SIDES[::-1]
                    for side in order:
                        await anyio.sleep(settle_s)
                        await timed(f"{mode}_{side}", actions[side])
                        await upkeep_settled(coord.ledger)  # untimed: the ledger's upkeep is done
            for client in clients.values():  # discovery, fresh connections
                client.use("fresh")
            for index in range(cycles):
                for side in SIDES if index % 2 == 0 else SIDES[::-1]:
                    await timed(f"discover_{side}", coord.discover if side == "quiesce" else gym.discover)
    finally:
        for client in clients.values():
            await client.aclose()
    out["participants"] = len(discovered.participants)
    out["episodes"] = len(scope)
    for key, values in took.items():
        out[f"{key}_s"] = statistics.median(values)
        out[f"{key}_cpu_s"] = statistics.median(cpu[key])
        out[f"{key}_servers_cpu_s"] = statistics.median(servers_cpu[key])
        out[f"{key}_connects_max"] = max(connects[key])
        out[f"{key}_connects_min"] = min(connects[key])
    for mode in (*MODES, "discover"):
        out[f"{mode}_ratio"] = out[f"{mode}_quiesce_s"] / out[f"{mode}_gym_s"]
        pairs = zip(took[f"{mode}_quiesce"], took[f"{mode}_gym"], strict=True)
        out[f"{mode}_paired_ratio"] = statistics.median(q / g for q, g in pairs)
    return out


def _span(runs: list[dict[str, Any]], key: str) -> str:
    """The fewest–most connections one timed save opened, over every save of ``runs``."""
    low, high = min(r[f"{key}_min"] for r in runs), max(r[f"{key}_max"] for r in runs)
    return str(low) if low == high else f"{low}–{high}"


def measure(ctx: Context) -> Result:
    """Measure #11 (see the module docstring)."""
    sizes = ctx.sizes or (QUICK_SIZES if ctx.quick else SIZES)
    cycles = 1 if ctx.quick else CYCLES
    processes = 2 if ctx.quick else PROCESSES
    result = Result(
        11,
        "v2 save by quiesce vs Gym's own stateless coordination, N distinct origins, episodes running",
        "quiesce / Gym's coordination <= 1.2x at N=512, reusing connections and on fresh ones",
    )
    token = "bench-" + secrets.token_hex(8)
    table: dict[int, list[dict[str, Any]]] = {}
    for n in sizes:
        for index in range(ctx.runs):  # a fresh cluster per run (module docstring)
            with (
                spawn_parts(n, token, ctx.work, processes) as (urls, pids),
                running_episodes(episode_envs(urls, processes), 1) as scope,
            ):
                folder = ctx.work / f"gymscale-{n}-run-{index}"
                folder.mkdir()
                params = {"urls": urls, "token": token, "cycles": cycles, "dir": str(folder), "pids": pids,
                          "first": SIDES[index % 2], "scope": scope}  # fmt: skip
                run = run_child("gymscale:run_gymscale", params, timeout_s=3600)
            table.setdefault(n, []).append(run)
            ctx.log(f"  N={run['participants']} run {index + 1}/{ctx.runs}: reuse"
                    f" {run['reuse_quiesce_s']:.3f} s vs {run['reuse_gym_s']:.3f} s"
                    f" ({run['reuse_ratio']:.2f}x);"
                    f" fresh {run['fresh_quiesce_s']:.3f} s vs {run['fresh_gym_s']:.3f} s"
                    f" ({run['fresh_ratio']:.2f}x); same calls: {run['same_calls']}")  # fmt: skip
    same = all(r["same_calls"] for runs in table.values() for r in runs)
    for n in sizes:
        runs = table[n]
        participants = int(runs[0]["participants"])
        for mode, label in (("reuse", "reused"), ("fresh", "fresh: one per call"), ("discover", "discovery")):
            q, g = stats_of(runs, f"{mode}_quiesce_s"), stats_of(runs, f"{mode}_gym_s")
            ratio, paired = stats_of(runs, f"{mode}_ratio"), stats_of(runs, f"{mode}_paired_ratio")
            q_cpu, g_cpu = stats_of(runs, f"{mode}_quiesce_cpu_s"), stats_of(runs, f"{mode}_gym_cpu_s")
            result.rows.append({
                "N": participants,
                "connections": label,
                "quiesce (s)": q.fmt(1, 3),
                "Gym's coordination (s)": g.fmt(1, 3),
                "quiesce / Gym": ratio.fmt(1, 2),
                "paired ratio": paired.fmt(1, 2),
                "quiesce CPU (s)": q_cpu.fmt(1, 3),
                "Gym side CPU (s)": g_cpu.fmt(1, 3),
                "quiesce CPU per participant (ms)": f"{q_cpu.median / participants * 1e3:.2f}",
                "servers' CPU, quiesce / Gym (s)":
                    f"{stats_of(runs, f'{mode}_quiesce_servers_cpu_s').median:.3f}"
                    f" / {stats_of(runs, f'{mode}_gym_servers_cpu_s').median:.3f}",
                "connections opened per save, quiesce / Gym": " / ".join(
                    _span(runs, f"{mode}_{side}_connects") for side in SIDES
                ),
            })  # fmt: skip
            for name, figure, unit in (("quiesce_s", q, "s"), ("gym_s", g, "s"), ("ratio", ratio, "x"),
                                       ("paired_ratio", paired, "x"), ("quiesce_cpu_s", q_cpu, "s"),
                                       ("gym_cpu_s", g_cpu, "s")):  # fmt: skip
                result.metric(f"{mode}_{name}_{participants}", figure, unit)
    everything = [r for runs in table.values() for r in runs]
    result.metric("peak_rss_mb", Stats.of([r["peak_rss_mb"] for r in everything]), "MB")
    result.metric("same_calls", Stats.of([float(r["same_calls"]) for r in everything]), "fraction")
    result.runs = ctx.runs
    top = table[sizes[-1]]
    participants = int(top[0]["participants"])
    reuse, fresh = stats_of(top, "reuse_ratio"), stats_of(top, "fresh_ratio")
    result.value = (
        f"N={participants}: quiesce {stats_of(top, 'reuse_quiesce_s').fmt(1, 3, 's')} reusing connections ="
        f" {reuse.fmt(1, 2)}x Gym's coordination; {stats_of(top, 'fresh_quiesce_s').fmt(1, 3, 's')} on fresh"
        f" ones = {fresh.fmt(1, 2)}x"
        + ("" if same else "; the two sides did NOT send the same control calls (see the notes)")
    )
    result.baseline = (
        f"Gym's calls in Gym's order, no ledger, same servers, scope, deadline and HTTP client, same run:"
        f" {stats_of(top, 'reuse_gym_s').fmt(1, 3, 's')} reusing,"
        f" {stats_of(top, 'fresh_gym_s').fmt(1, 3, 's')} fresh"
    )
    result.met = same and participants >= 512 and reuse.median <= 1.2 and fresh.median <= 1.2
    if participants < 512:
        result.met = None  # the goal is stated at 512
    result.side(
        "quiesce (Coordinator.checkpoint(episodes=scope))",
        durability="full (SQLite WAL ledger; every call recorded before it leaves and after its reply)",
        transport="loopback HTTP, coordinator/http.py; reuse: one pooled client; fresh: a new connection"
        " per call (ModeClient)",
        order="pairs, which side goes first alternating; the same settle time before both saves of a pair",
        work="prepare by stage, commit with the scope, every reply verified against the files (sha256),"
        " publication (manifest, fsync, rename, LATEST), resume in reverse stage order",
    )
    result.side(
        "Gym's coordination (tools/bench/gymcoord.py)",
        durability="none: no ledger",
        transport="the same client class, a client of its own",
        order="the same",
        work="Gym's calls in Gym's order (prepare by stage, commit all, resume in reverse stage order);"
        " the staging folder renamed into place; nothing verified",
    )
    calls = top[0]
    result.notes.append(
        f"same control calls on both sides (each server's control log, one untimed save each per run):"
        f" {'yes' if same else 'NO'} — {calls['calls_quiesce']} calls per save by quiesce,"
        f" {calls['calls_gym']} by Gym's coordination at N={participants}"
        + ("" if same else f"; differing (server, method, route): {', '.join(calls['calls_differ'])}")
        + f". Discovery (not part of a save): {calls['discover_calls_quiesce']} calls by quiesce,"
        f" {calls['discover_calls_gym']} by Gym's coordination"
    )
    result.notes.append(
        f"cluster: {processes} gymsim processes of v2 servers, every server on its own port; 1 policy model"
        f" ({MODEL_LATENCY_S * 1e3:.0f} ms per call), environment → agent → resources chains;"
        f" {top[0]['episodes']} episodes running (one per environment, the first {EPISODE_ENVS_PER_PROCESS}"
        f" environments of each process); the scope of every save = those episodes; deadline"
        f" {DEADLINE_S:.0f} s"
    )
    result.notes.append(
        f"{cycles} pairs per connection mode per run; a fresh cluster per run; before each save the episodes"
        f" run {SETTLE_S * 1e3:.0f} ms plus a random part of one turn (untimed, the same for both saves of a"
        " pair). 'paired ratio' is the median of quiesce/Gym over a run's pairs; 'quiesce / Gym' the ratio"
        " of the run's medians (the goal is judged on it)"
    )
    result.notes.append(
        "Gym's own coordination module sends on Gym's ServerClient (aiohttp); here it sends on quiesce's HTTP"
        " client, the faster of the two on this machine (coordinator/http.py's docstring: 187 vs 320 µs of"
        " CPU per call at 512 servers), so the floor is lower than a Gym deployment's and the ratio is not"
        " flattered by the client"
    )
    result.notes.append(
        f"'reused': an idle pooled connection is reused for up to {REUSE_IDLE_S:g} s on both sides (the"
        " production client's limit, 1.5 s, is shorter than a pair of 512-server saves, so a pool emptied"
        " whenever the other side's save ran between two of one side's own); the 'connections opened per"
        " save' column shows what each mode did in every timed save of the runs"
    )
    return result


__all__ = [
    "GymCoordination",
    "ModeClient",
    "measure",
    "run_gymscale",
    "spawn_parts",
    "spec_parts",
]
