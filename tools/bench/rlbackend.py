"""Measure #14 — a snapshot through quiesce's NeMo RL backend (``quiesce.rl``) vs the embedded
coordinator, on the same servers (issue #39).

The cluster (a fresh one per run): two gymsim v2 deployments, each in its own process, as NeMo RL
runs replicas of one Gym config — the default v2 deployment (environment → agent → policy model +
resources), its servers named ``nemo_gym.r<i>.<name>`` (``quiesce.rl.deployments``' naming) and
still reporting their original names as their instances, each deployment writing into its own
folder ``gym-instances/nemo_gym/replica-<i>`` (what the backend reads RL's instance id from).
``EPISODES`` episodes per deployment run two turns and park at that boundary (a paced trainer in
a thread of the bench's process, never in the measured child): nothing advances them, so every
save of a run commits the same episodes and the same state, and no save waits for a turn to drain.

One run (``run_snapshots``, a fresh process), two sides on that one cluster:

- **embedded**: an open ``Coordinator``; ``async with coord.save(deadline_s=D, episodes=scope,
  into=folder)`` with nothing in the block — prepare, commit into the caller's folder, publish
  there in place, resume.
- **backend**: an open ``QuiesceEnvironmentCheckpoint`` in the same process (as RL's driver holds
  it; no Ray on the timed path), built with the same deadline, ``scope`` returning the same
  episodes and ``expected`` returning them too; ``async with backend.snapshot(folder) as snap:
  await snap.check_against_cut(cut)`` — the same save plus what the backend adds: its own
  bookkeeping, RL's ``gym_checkpoint.json`` (written atomically, fsynced, folder fsynced) and the
  cut check.
- **actors** (reported, not judged): RL's own cross-actor coordinator's calls over quiesce's
  per-actor methods (``quiesce.rl.actors.ActorCheckpointHost``, in the same process, its handles
  called directly): every instance's ``checkpoint_prepare``, one round of ``checkpoint_renew``
  (RL renews once right after the prepare), every instance's ``checkpoint_commit`` (each given
  every parked episode as its candidates), ``gym_checkpoint.json`` written as RL's coordinator
  writes it, every instance's ``checkpoint_resume`` — the calls of each step concurrent, as RL
  sends them. Its extra over the embedded save is the joins, the renewal round and the manifest.

Rules both sides keep: each its own SQLite ledger file in the run's folder, durability "full"
(the default); the same servers, token, deadline and scope (given explicitly to both); a fresh
folder per save, made before the timer starts (RL makes its snapshot folder before it calls
``snapshot``); one untimed warm-up save each; ``ROUNDS`` measured rounds of one save per side,
the side going first alternating from round to round, each save after the same untimed pause.
Wall time (``perf_counter``) and this process's CPU (``process_time``, all threads) per save.

Judged: the backend's extra wall time per save — the backend side's median minus the embedded
side's, per run; median over runs — <= 10 ms. The ratio of the medians is reported beside it, and
every run's saves pooled per side give a bootstrap interval of the difference (``cycle.pooled_difference``).
"""

from __future__ import annotations

import contextlib
import secrets
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from quiesce.coordinator import Coordinator, parse_config
from quiesce.coordinator.config import ClusterConfig
from quiesce.coordinator.protocol import TOKEN_ENV
from quiesce.coordinator.protocol_v2 import EpisodeId
from quiesce.coordinator.publish import IN_PLACE_MANIFEST
from quiesce.rl.actors import ActorCheckpointHost, instance_handles
from quiesce.rl.backend import QuiesceEnvironmentCheckpoint
from quiesce.rl.episodes import Episode
from quiesce.rl.gym_manifest import MANIFEST_FILENAME, GymCheckpointManifest
from quiesce.tools.bench.cycle import interval_text, pooled_difference
from quiesce.tools.bench.episodes import running_episodes
from quiesce.tools.bench.harness import Context, Result, Stats, bootstrap_difference, run_child, stats_of
from quiesce.tools.gymsim.cluster import spawn_cluster
from quiesce.tools.gymsim.spec import default_v2_spec, replica_spec

#: Gym deployments (RL replicas) in the cluster, and episodes parked on each.
DEPLOYMENTS = 2
EPISODES = 4
#: Turns each episode runs before it parks (every save then holds two turns of state per episode).
TURNS_IN = 2
#: Measured rounds per run (one save per side each).
ROUNDS = 200
#: Untimed pause before every save, the same for both sides.
PAUSE_S = 0.02
#: Every save's deadline, both sides.
DEADLINE_S = 30.0
#: The judged goal: the backend's extra wall time per save.
GOAL_S = 0.010
SIDES = ("embedded", "backend", "actors")


def replica_of(index: int) -> str:
    """RL's instance id of deployment ``index`` (shard ``nemo_gym``, unsharded)."""
    return f"nemo_gym/replica-{index}"


def deployment_spec(index: int) -> dict[str, Any]:
    """The default v2 deployment as RL's replica ``index`` (``replica_spec``): servers
    ``nemo_gym.r<index>.<name>``, each still reporting its own name as its instance."""
    return replica_spec(default_v2_spec(), f"nemo_gym.r{index}.").model_dump(mode="json")


@dataclass
class Cut:
    """RL's data-plane cut as the backend sees it: held (``require_live`` passes) until released."""

    held: bool = True

    def require_live(self) -> None:
        if not self.held:
            raise RuntimeError("the data-plane barrier was released")


def side_config(servers: list[dict[str, Any]], folder: Path, side: str) -> ClusterConfig:
    """One side's cluster config: the same servers and deadline, its own SQLite ledger file in
    ``folder`` (durability "full", the default) and its own snapshots folder (unused: every save
    goes into a folder of the caller's)."""
    document = {
        "ledger": f"sqlite+aiosqlite:///{folder / f'{side}.db'}",
        "snapshots": str(folder / f"{side}-snapshots"),
        "deadline_s": DEADLINE_S,
        "servers": servers,
    }
    return parse_config(document, base_dir=folder)


@asynccontextmanager
async def open_sides(
    servers: list[dict[str, Any]], token: str, folder: Path, scope: list[EpisodeId]
) -> AsyncIterator[tuple[Coordinator, QuiesceEnvironmentCheckpoint, ActorCheckpointHost]]:
    """The embedded coordinator, the backend and the per-actor host, each discovered and started,
    closed on exit."""
    episodes = list(scope)
    async with Coordinator.open(side_config(servers, folder, "embedded"), token=token) as coord:
        await coord.discover()
        backend = QuiesceEnvironmentCheckpoint(
            side_config(servers, folder, "backend"),
            token=token,
            deadline_s=DEADLINE_S,
            scope=lambda: episodes,
            expected=lambda cut: episodes,
        )
        host = ActorCheckpointHost(side_config(servers, folder, "actors"), token=token)
        try:
            async with backend:
                await host.start()
                yield coord, backend, host
        finally:
            with anyio.CancelScope(shield=True):
                await host.close()


async def embedded_save(coord: Coordinator, into: Path, scope: list[EpisodeId]) -> None:
    """One save on the embedded side: committed into ``into``, published there in place, resumed."""
    async with coord.save(deadline_s=DEADLINE_S, episodes=scope, into=into):
        pass


async def backend_save(backend: QuiesceEnvironmentCheckpoint, into: Path) -> None:
    """One snapshot through the backend, as RL's controller takes it (RL's own half not written)."""
    cut = Cut()
    async with backend.snapshot(into) as snap:
        await snap.check_against_cut(cut)
        cut.held = False


async def actors_save(host: ActorCheckpointHost, into: Path, name: str, scope: list[EpisodeId]) -> None:
    """One snapshot as RL's cross-actor coordinator takes it over the per-actor methods (module
    docstring): prepare, renew, commit, RL's ``gym_checkpoint.json``, resume."""
    handles = instance_handles(host, await host.instances())
    candidates = tuple(sorted(Episode.from_episode_id(e) for e in scope))
    checkpoint_id = f"rl-{name}"

    async def each(call: Any) -> dict[str, Any]:
        results: dict[str, Any] = {}

        async def one(instance: str, handle: Any) -> None:
            results[instance] = await call(handle)

        async with anyio.create_task_group() as tg:
            for instance, handle in handles.items():
                tg.start_soon(one, instance, handle)
        return results

    def deadline() -> float:
        return time.time() + DEADLINE_S

    ts = deadline()
    prepared = await each(lambda h: h.checkpoint_prepare.remote(checkpoint_id, deadline_ts=ts))
    if not all(p.prepared for p in prepared.values()):
        raise RuntimeError(f"not prepared: {prepared}")
    ts = deadline()
    await each(lambda h: h.checkpoint_renew.remote(checkpoint_id, deadline_ts=ts))
    ts = deadline()
    summaries = await each(
        lambda h: h.checkpoint_commit.remote(checkpoint_id, str(into), candidates, deadline_ts=ts)
    )
    manifest = GymCheckpointManifest.from_commit(checkpoint_id, summaries)
    await anyio.to_thread.run_sync(manifest.write, into)
    ts = deadline()
    await each(lambda h: h.checkpoint_resume.remote(checkpoint_id, deadline_ts=ts))


def folder_files(folder: Path) -> tuple[int, int]:
    """Files under ``folder`` and their bytes."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


async def run_snapshots(
    servers: list[dict[str, Any]], token: str, scope: list[dict[str, Any]], rounds: int, dir: str
) -> dict[str, Any]:
    """One run of #14 (module docstring): ``rounds`` measured saves per side after one warm-up each."""
    folder = Path(dir)
    episodes = [EpisodeId.model_validate(e) for e in scope]
    saves = folder / "rl"
    saves.mkdir()
    took: dict[str, list[float]] = {side: [] for side in SIDES}
    cpu: dict[str, list[float]] = {side: [] for side in SIDES}
    async with open_sides(servers, token, folder, episodes) as (coord, backend, host):

        async def one(side: str, name: str) -> tuple[float, float, Path]:
            into = saves / f"{side}-{name}"
            into.mkdir()
            await anyio.sleep(PAUSE_S)
            start, begun = time.perf_counter(), time.process_time()
            if side == "embedded":
                await embedded_save(coord, into, episodes)
            elif side == "backend":
                await backend_save(backend, into)
            else:
                await actors_save(host, into, name, episodes)
            wall, used = time.perf_counter() - start, time.process_time() - begun
            if not (into / IN_PLACE_MANIFEST).is_file():
                raise RuntimeError(f"{side} save into {into} was not published")
            return wall, used, into

        warm = {side: (await one(side, "warmup"))[2] for side in SIDES}
        for i in range(rounds):
            for side in SIDES[i % len(SIDES) :] + SIDES[: i % len(SIDES)]:  # each side first in turn
                wall, used, _ = await one(side, f"{i:04d}")
                took[side].append(wall)
                cpu[side].append(used)
        events: dict[str, int] = {}
        ledgers = {
            "embedded": coord.ledger,
            "backend": backend.coordinator.ledger,
            "actors": host.coordinator.ledger,
        }
        for side, ledger in ledgers.items():
            head = await ledger.head()
            events[side] = head.seq if head is not None else 0
    manifest = warm["backend"] / MANIFEST_FILENAME
    if not manifest.is_file():
        raise RuntimeError(f"the backend wrote no {MANIFEST_FILENAME} into {warm['backend']}")
    files = {side: folder_files(warm[side]) for side in SIDES}
    out: dict[str, Any] = {"samples": {side: {"wall_s": took[side], "cpu_s": cpu[side]} for side in SIDES}}
    for side in SIDES:
        out[f"{side}_s"] = statistics.median(took[side])
        out[f"{side}_cpu_s"] = statistics.median(cpu[side])
        out[f"{side}_files"], out[f"{side}_bytes"] = files[side]
        out[f"{side}_events_per_save"] = events[side] / (rounds + 1)
    out["extra_s"] = out["backend_s"] - out["embedded_s"]
    out["extra_ci"] = bootstrap_difference(took["backend"], took["embedded"])
    out["extra_cpu_s"] = out["backend_cpu_s"] - out["embedded_cpu_s"]
    out["actors_extra_s"] = out["actors_s"] - out["embedded_s"]
    out["actors_extra_cpu_s"] = out["actors_cpu_s"] - out["embedded_cpu_s"]
    out["actors_ratio"] = out["actors_s"] / out["embedded_s"]
    # for reference only: the two saves of one round ran back to back
    out["paired_s"] = statistics.median(
        [b - e for b, e in zip(took["backend"], took["embedded"], strict=True)]
    )
    out["ratio"] = out["backend_s"] / out["embedded_s"]
    out["manifest_bytes"] = manifest.stat().st_size
    out["episodes"] = len(episodes)
    return out


def one_run(ctx: Context, index: int, token: str, rounds: int) -> dict[str, Any]:
    """One run of #14: a fresh cluster of ``DEPLOYMENTS`` deployments, parked episodes, one child."""
    with contextlib.ExitStack() as stack:
        deployments = [
            stack.enter_context(
                spawn_cluster(
                    deployment_spec(i),
                    env={TOKEN_ENV: token},
                    workdir=ctx.work / f"rlbackend-{index}-cluster-{i}-{secrets.token_hex(4)}",
                )
            )
            for i in range(DEPLOYMENTS)
        ]
        servers = [
            {"name": name, "url": url, "folder": f"gym-instances/{replica_of(i)}"}
            for i, running in enumerate(deployments)
            for name, url in running.urls.items()
        ]
        envs = {
            f"replica-{i}": running.urls[f"nemo_gym.r{i}.environment"]
            for i, running in enumerate(deployments)
        }
        folder = ctx.work / f"rlbackend-{index}"
        folder.mkdir()
        with running_episodes(envs, EPISODES, parked_after=TURNS_IN) as scope:
            params = {
                "servers": servers,
                "token": token,
                "scope": scope,
                "rounds": rounds,
                "dir": str(folder),
            }
            return run_child("rlbackend:run_snapshots", params)


def measure(ctx: Context) -> Result:
    """Measure #14 (module docstring)."""
    rounds = 3 if ctx.quick else ROUNDS
    result = Result(
        14,
        "NeMo RL backend: a snapshot through quiesce.rl vs the embedded coordinator, 2 Gym deployments",
        "the backend adds <= 10 ms per snapshot (difference of medians)",
    )
    token = "bench-" + secrets.token_hex(8)
    runs: list[dict[str, Any]] = []
    for index in range(ctx.runs):
        last = one_run(ctx, index, token, rounds)
        runs.append(last)
        ctx.log(
            f"  run {index + 1}/{ctx.runs}: backend {last['backend_s'] * 1e3:.1f} ms, embedded"
            f" {last['embedded_s'] * 1e3:.1f} ms, extra {last['extra_s'] * 1e3:.2f} ms"
        )
    result.runs = ctx.runs
    names = {
        "backend_s": "backend_s", "embedded_s": "embedded_s", "extra_s": "extra_s", "ratio": "ratio",
        "backend_cpu_s": "backend_cpu_s", "embedded_cpu_s": "embedded_cpu_s", "extra_cpu_s": "extra_cpu_s",
        "paired_s": "paired_s", "actors_s": "actors_s", "actors_cpu_s": "actors_cpu_s",
        "actors_extra_s": "actors_extra_s", "actors_extra_cpu_s": "actors_extra_cpu_s",
        "actors_ratio": "actors_ratio",
    }  # fmt: skip
    f: dict[str, Stats] = {}
    for metric, key in names.items():
        f[metric] = stats_of(runs, key)
        result.metric(metric, f[metric], "x" if metric.endswith("ratio") else "s")
    pooled = pooled_difference(runs, "backend", "embedded")
    result.metric("extra_pooled_s", pooled, "s (median difference [95% bootstrap interval])")
    result.metric("peak_rss_mb", stats_of(runs, "peak_rss_mb"), "MB")
    result.metric("manifest_bytes", stats_of(runs, "manifest_bytes"), "bytes")
    result.met = f["extra_s"].median <= GOAL_S
    first = runs[0]
    files = (
        f"the backend's folder holds {first['backend_files']} files ({first['backend_bytes']:,} bytes), the"
        f" embedded one's {first['embedded_files']} ({first['embedded_bytes']:,} bytes): the difference is"
        f" {MANIFEST_FILENAME} ({first['manifest_bytes']:,} bytes)"
    )
    result.value = (
        f"backend {f['backend_s'].fmt(1e3, 1, 'ms')} per snapshot, extra {f['extra_s'].fmt(1e3, 2, 'ms')}"
        f" wall (all runs pooled: {interval_text(pooled)}) = ratio {f['ratio'].fmt(1, 3)},"
        f" {f['extra_cpu_s'].fmt(1e3, 2, 'ms')} CPU"
    )
    result.baseline = (
        f"embedded coordinator {f['embedded_s'].fmt(1e3, 1, 'ms')} per save into the same kind of folder"
        f" (CPU {f['embedded_cpu_s'].fmt(1e3, 1, 'ms')})"
    )
    for side in SIDES:
        result.rows.append({
            "side": side,
            "wall (ms per save)": f[f"{side}_s"].fmt(1e3, 1),
            "CPU (ms per save)": f[f"{side}_cpu_s"].fmt(1e3, 1),
            "files written per save": str(first[f"{side}_files"]),
            "ledger events per save": f"{first[f'{side}_events_per_save']:.0f}",
        })  # fmt: skip
    result.rows.append({
        "side": "backend - embedded",
        "wall (ms per save)": f"{f['extra_s'].fmt(1e3, 2)} (pooled: {interval_text(pooled)};"
        f" paired, for reference: {f['paired_s'].fmt(1e3, 2)})",
        "CPU (ms per save)": f["extra_cpu_s"].fmt(1e3, 2),
        "files written per save": f"+1 ({MANIFEST_FILENAME})",
        "ledger events per save": "",
    })  # fmt: skip
    actors_pooled = pooled_difference(runs, "actors", "embedded")
    result.metric("actors_extra_pooled_s", actors_pooled, "s (median difference [95% bootstrap interval])")
    result.rows.append({
        "side": "actors - embedded (reported, not judged)",
        "wall (ms per save)": f"{f['actors_extra_s'].fmt(1e3, 2)} (pooled: {interval_text(actors_pooled)});"
        f" ratio {f['actors_ratio'].fmt(1, 3)}",
        "CPU (ms per save)": f["actors_extra_cpu_s"].fmt(1e3, 2),
        "files written per save": f"+1 ({MANIFEST_FILENAME})",
        "ledger events per save": "",
    })  # fmt: skip
    common = {
        "durability": "full (SQLite WAL, its own ledger file in the run's folder)",
        "transport": "loopback HTTP, coordinator/http.py, to the same 8 servers",
        "order": "one warm-up each, then rounds of one save per side, each side first in turn;"
        f" {PAUSE_S * 1e3:.0f} ms untimed pause before every save",
        "cluster": f"a fresh one per run: {DEPLOYMENTS} gymsim v2 deployments (own processes, shared instance"
        f" names, folders gym-instances/nemo_gym/replica-<i>), {EPISODES} episodes each parked after"
        f" {TURNS_IN} turns",
        "scope": f"the {DEPLOYMENTS * EPISODES} parked episodes, given explicitly;"
        f" deadline {DEADLINE_S:.0f} s",
    }
    result.side(
        "backend (quiesce.rl.backend.QuiesceEnvironmentCheckpoint, in-process)",
        **{
            **common,
            "call": "async with backend.snapshot(fresh folder) as snap: await snap.check_against_cut(cut)",
        },
    )
    result.side(
        "actors (quiesce.rl.actors.ActorCheckpointHost, in-process, RL's coordinator's calls)",
        **{
            **common,
            "call": "every instance's checkpoint_prepare, one checkpoint_renew round, every"
            " checkpoint_commit, gym_checkpoint.json, every checkpoint_resume (each step's calls concurrent)",
        },
    )
    result.side(
        "embedded (Coordinator.save)",
        **{**common, "call": "async with coord.save(deadline_s, episodes=scope, into=fresh folder): pass"},
    )
    result.notes.append(
        f"what the extra buys: {files}, written atomically (temporary file, fsync, rename, folder fsync)"
        " after the commit and before the block, so RL's own tooling reads the snapshot; and the cut check"
        " (the episodes RL has in flight against the committed scope). Ledger events per save (first run):"
        f" backend {first['backend_events_per_save']:.1f}, embedded {first['embedded_events_per_save']:.1f}"
    )
    result.notes.append(
        "'extra' (judged): per run, the backend's median save minus the embedded side's; median"
        " [min–max] over the runs. Beside it, every run's saves pooled per side: the difference of the"
        " pooled medians and its 95% bootstrap interval (2,000 resamples of each side on its own); the"
        " median of per-round differences (the two saves of one round) for reference only. Every"
        " save's wall and CPU time per side is in the JSON (`raw`)"
    )
    result.notes.append(
        f"{rounds} measured saves per side per run. Both sides in one child process on one cluster; the"
        " episodes are parked, so no save waits for a model call to drain and every save commits the same"
        " state: the figure is the backend's own cost, not where a save lands in a turn. RL's own half (its"
        " files, written inside the block) is written by neither side. No Ray on the timed path: the backend"
        " runs in the process that times it, as on RL's driver; a backend hosted in a Ray actor"
        " (quiesce.rl.host) adds Ray's calls (begin, check, finish), not measured here"
    )
    result.notes.append(
        "actors (reported, not judged): RL's cross-actor coordinator's calls over quiesce's per-actor"
        " host, in process, its handles called directly (RL calls them across Ray: a round trip per call"
        " more, not measured here). Its extra over the embedded save is the host's joins, the renewal"
        " round RL sends right after every prepare, and gym_checkpoint.json; ledger events per save"
        f" (first run): actors {first['actors_events_per_save']:.1f}"
    )
    return result


__all__ = [
    "Cut",
    "actors_save",
    "backend_save",
    "deployment_spec",
    "embedded_save",
    "measure",
    "one_run",
    "run_snapshots",
]
