"""Ledgers made of recorded real cycles — the history behind measures #5, #6 and #8.

``record_corpus`` runs real coordinators against real reference clusters of three sizes (4
servers with rollouts running; 16 and 64 participants, one rollout per agent) and records, in one
SQLite ledger, what a user's ledger holds: saves, a save rolled back (a resources commit fails),
a coordinator SIGKILLed mid-save followed by the recovery of the next one, and a restore of the
last snapshot into a fresh cluster with its resume — each with the discovery that precedes it.
Nothing in it is synthetic.

``build_history`` makes an N-event ledger from that corpus: it appends the corpus's events again
and again, in their order, into a fresh ledger (through ``Ledger.append_many`` in batches, at
durability "process"; a ``coordinator.started`` starts a new epoch, as a new coordinator does),
giving every repeat its own checkpoint ids (the old id replaced in the payload text too) so that
attempts never collide. Every attempt of the result is finished. With ``rollouts`` (measure #13),
the rollout ids of its lineage events rotate through that many ids: each save's rollouts get the
next ids of the rotation (``r000000``, ``r000001``, ... wrapping at ``rollouts``), and the restores
and acknowledgements after it name them by those ids, so the lineage of the history spans that
many distinct rollouts, each captured, ended, continued as the corpus's cycles do. The ledger is cached under
``bench-results/.cache`` keyed by the corpus's and the schema's identity, and regenerated when
this code refuses it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from quiesce.coordinator import Coordinator, PhaseError
from quiesce.coordinator.crashpoints import CRASH_BEFORE_SEND
from quiesce.coordinator.protocol import RESOURCES, TOKEN_ENV, route
from quiesce.ledger import AppendItem, Event, Ledger, LedgerError
from quiesce.ledger.layout import HEAD_REVISION
from quiesce.ledger.rollout_refs import REF_KINDS
from quiesce.tools.bench.harness import REPO_ROOT, BenchError, Context, child_env, run_child
from quiesce.tools.gymsim import client
from quiesce.tools.gymsim.cluster import spawn_cluster, write_yaml_atomic

#: Corpus recipe version: bump when ``record_corpus`` changes, so cached ledgers are rebuilt.
CORPUS_VERSION = 2
#: History recipe version: bump when ``_build`` changes, so cached histories are rebuilt.
BUILD_VERSION = 2
#: Saves recorded per cluster size (before the rolled-back one): small clusters, many attempts.
SAVES = {4: 20, 16: 6, 64: 3}
_ID = re.compile(r"^e(\d+)-(.+)$")


def _spec(size: int) -> dict[str, Any]:
    if size == 4:
        from quiesce.tools.bench.cycle import SPEC

        return SPEC
    from quiesce.tools.bench.scale import spec_for

    return spec_for(size)


async def _rollouts(urls: dict[str, str], per_agent: int) -> None:
    agents = [name for name in urls if "agent" in name]
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        for name in agents:
            await client.start_rollouts(http, urls[name], {f"r{i}": 1_000_000 for i in range(per_agent)})
        for name in agents:
            await client.wait_turns(http, urls[name], 1, timeout_s=60)


async def _fail_next_resources_commit(url: str) -> None:
    fault = {"kind": "fail", "path": route(RESOURCES, "commit").full_path, "times": 1, "status": 500}
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        reply = await http.post(f"{url}/gymsim/admin/faults", json={"faults": [fault]})
        reply.raise_for_status()


async def _cycles(config: Path, token: str, resources_url: str, saves: int) -> str:
    """Saves, then a save rolled back by a failing resources commit; the last snapshot's path."""
    async with Coordinator.open(str(config), token=token) as coord:
        await coord.discover()
        snapshot = None
        for _ in range(saves):
            snapshot = (await coord.checkpoint()).snapshot
        await _fail_next_resources_commit(resources_url)
        try:
            await coord.checkpoint()
        except PhaseError:
            pass  # rolled back, as intended
        else:
            raise BenchError("the injected resources commit failure did not roll the save back")
    assert snapshot is not None
    return str(snapshot)


async def _restore(config: Path, token: str, snapshot: str) -> None:
    """Restore ``snapshot`` into a fresh cluster, then resume it (a restore needs fresh servers)."""
    async with Coordinator.open(str(config), token=token) as coord:
        await coord.discover()
        await coord.restore(Path(snapshot))
        await coord.resume()


async def crash_save(config: str) -> dict[str, Any]:
    """Discover and save; the crash point kills this process mid-save (never returns normally)."""
    async with Coordinator.open(config) as coord:
        await coord.discover()
        await coord.checkpoint()
    return {"crashed": False}


def crash_mid_save(config: Path, token: str, crash_before_send: int) -> None:
    """A coordinator process SIGKILLed right before its ``crash_before_send``-th request."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "quiesce.tools.bench.child",
            "history:crash_save",
            json.dumps({"config": str(config)}),
        ],
        cwd=str(REPO_ROOT),
        env={**child_env(), TOKEN_ENV: token, CRASH_BEFORE_SEND: str(crash_before_send)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != -signal.SIGKILL:
        raise BenchError(f"the coordinator was not SIGKILLed (exit {done.returncode}): {done.stderr[-800:]}")


async def _recover(config: Path, token: str) -> None:
    async with Coordinator.open(str(config), token=token) as coord:
        report = coord.last_recovery
        if report is None or not report.attempts:
            raise BenchError("the recovery after the crash found nothing to recover")


def record_corpus(path: str, work: str, sizes: list[int], saves: int | None = None) -> dict[str, Any]:
    """Record real cycles on clusters of ``sizes`` into the new SQLite ledger at ``path``
    (``saves`` saves per cluster before the rolled-back one; default ``SAVES`` by size)."""
    folder = Path(work)
    token = "bench-" + secrets.token_hex(8)
    url = f"sqlite+aiosqlite:///{path}"
    started = time.perf_counter()
    for size in sizes:
        spec = _spec(size)
        snapshots = folder / f"snapshots-{size}"
        with spawn_cluster(spec, env={TOKEN_ENV: token}, workdir=folder / f"corpus-{size}") as running:
            anyio.run(_rollouts, running.urls, 4 if size == 4 else 1)
            document = running.config(url, snapshots, fanout="parallel", keep_latest=2)
            config = write_yaml_atomic(folder / f"corpus-{size}.yaml", document)
            resources = next(name for name in running.urls if name.startswith("tools"))
            snapshot = anyio.run(_cycles, config, token, running.urls[resources], saves or SAVES.get(size, 3))
            # killed after discovery (every server read) and the prepare-phase POSTs, before the drain
            participants = len(running.urls) - (1 if size == 4 else 0)  # the judge is never paused
            crash_mid_save(config, token, len(running.urls) + participants + 1)
            anyio.run(_recover, config, token)
        with spawn_cluster(spec, env={TOKEN_ENV: token}, workdir=folder / f"corpus-{size}-b") as fresh:
            document = fresh.config(url, snapshots, fanout="parallel", keep_latest=2)
            config = write_yaml_atomic(folder / f"corpus-{size}-b.yaml", document)
            anyio.run(_restore, config, token, snapshot)
    return {"seconds": time.perf_counter() - started}


class _Rotation:
    """The rollout ids of the history's lineage events: each save gives every rollout id it names
    the next id of a rotation through ``size`` ids (see the module docstring)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.serial = 0
        self.names: dict[str, str] = {}

    def saving(self) -> None:
        """A save starts: its rollouts get fresh ids."""
        self.names = {}

    def name(self, rollout_id: str) -> str:
        name = self.names.get(rollout_id)
        if name is None:
            name = self.names[rollout_id] = f"r{self.serial % self.size:06d}"
            self.serial += 1
        return name

    def rename(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` of a lineage event of ``kind`` with its rollout ids renamed (v1 pairs, v2 keys)."""

        def pairs(items: Any) -> Any:
            if not isinstance(items, list):
                return items
            return [
                {**p, "rollout_id": self.name(p["rollout_id"])}
                if isinstance(p, dict) and isinstance(p.get("rollout_id"), str)
                else p
                for p in items
            ]

        def keys(items: Any) -> Any:
            from quiesce.ledger.lineage import episode_of_capture_key

            if not isinstance(items, list):
                return items
            out = []
            for key in items:
                rollout, attempt = episode_of_capture_key(str(key))
                out.append(self.name(rollout) + (f"-a{attempt}" if attempt else ""))
            return out

        data = dict(data)
        if kind in ("rollouts.captured", "rollouts.continued"):
            for field in ("captured", "continued", "discarded"):
                if isinstance(data.get(field), dict):
                    data[field] = {agent: pairs(items) for agent, items in data[field].items()}
        elif kind == "rollouts.acknowledged":
            data["executions"] = pairs(data.get("executions"))
        elif kind in ("episodes.scoped", "episodes.retired"):
            for field in ("scope", "episodes"):
                if field in data:
                    data[field] = keys(data[field])
        elif kind == "rollouts.forgotten":
            data["rollout_ids"] = [self.name(str(r)) for r in data.get("rollout_ids", [])]
        for field in ("exported", "restored", "restarts"):
            if isinstance(data.get(field), dict):
                data[field] = {server: keys(items) for server, items in data[field].items()}
        return data


def _remap(event: Event, ids: dict[str, str], new_id: Any, rotation: _Rotation | None = None) -> AppendItem:
    data = event.data
    if rotation is not None:
        if event.kind == "attempt.started" and data.get("kind") == "save":
            rotation.saving()
        elif event.kind in REF_KINDS:
            data = rotation.rename(event.kind, data)
    cid = event.checkpoint_id
    if cid is not None:
        if cid not in ids:
            ids[cid] = new_id(cid)
        text = json.dumps(data)
        for old, new in ids.items():
            if old in text:
                text = text.replace(old, new)
        data = json.loads(text)
        cid = ids[cid]
    call_id = event.call_id
    if call_id is not None and event.checkpoint_id is not None:
        call_id = call_id.replace(event.checkpoint_id, ids[event.checkpoint_id])
    return AppendItem(event.kind, checkpoint_id=cid, server=event.server, call_id=call_id, data=data)


async def _build(corpus: str, target: str, n: int, rollouts: int = 0) -> dict[str, Any]:
    """Append the corpus again and again until ``n`` events or more are written, stopping only where
    one of the corpus's coordinator processes ends (before a ``coordinator.started``, or at the
    corpus's end): a history cut inside a process could end between a restore and its resume, and
    then every server of the cluster counts as held by it — no user's ledger looks like that."""
    async with Ledger.open(f"sqlite+aiosqlite:///{corpus}", readonly=True) as source:
        events = [event async for event in source.read()]
    if not events or events[0].kind != "coordinator.started":
        raise BenchError(f"the corpus {corpus} does not start with coordinator.started")
    written = 0
    repeat = 0
    kinds: dict[str, int] = {}
    rotation = _Rotation(rollouts) if rollouts else None
    async with Ledger.open(f"sqlite+aiosqlite:///{target}", durability="process") as ledger:
        while written < n:
            repeat += 1
            ids: dict[str, str] = {}
            batch: list[AppendItem] = []

            def new_id(old: str, repeat: int = repeat) -> str:
                match = _ID.match(old)
                tail = match.group(2) if match else old
                return f"e{ledger.epoch}-r{repeat:05d}-{tail}"

            for event in events:
                if event.kind == "coordinator.started":
                    if written + len(batch) >= n:
                        break  # cut between two of the corpus's coordinator processes (see _build)
                    if batch:
                        await ledger.append_many(batch)
                        written += len(batch)
                        batch = []
                    await ledger.start_epoch(event.data)
                    written += 1
                    kinds[event.kind] = kinds.get(event.kind, 0) + 1
                    continue
                batch.append(_remap(event, ids, new_id, rotation))
                kinds[event.kind] = kinds.get(event.kind, 0) + 1
                if len(batch) >= 5000:
                    await ledger.append_many(batch)
                    written += len(batch)
                    batch = []
            if batch:
                await ledger.append_many(batch)
                written += len(batch)
            if written >= n:
                break
        unfinished = await ledger.unfinished_attempts()
        # a corpus cut short mid-attempt: close what it left open, as a recovery would
        for row in unfinished:
            await ledger.append("attempt.aborted", checkpoint_id=row.checkpoint_id,
                                data={"reason": "history cut here by the bench"})  # fmt: skip
            written += 1
        head = await ledger.head()
        attempts = len(await ledger.attempts())
    named = min(rotation.serial, rotation.size) if rotation is not None else 0
    return {"events": head.seq if head else 0, "repeats": repeat, "kinds": kinds, "attempts": attempts,
            "rollouts": named}  # fmt: skip


def build_history(corpus: str, path: str, n: int, rollouts: int = 0) -> dict[str, Any]:
    """Write a ledger of about ``n`` events (at least) made from ``corpus`` at ``path`` (via a
    temporary name, renamed when complete); ``rollouts``: see the module docstring."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    for leftover in target.parent.glob(tmp.name + "*"):
        leftover.unlink()
    start = time.perf_counter()
    info = anyio.run(_build, corpus, str(tmp), n, rollouts)
    for suffix in ("-wal", "-shm", ".writer-lock"):
        Path(f"{tmp}{suffix}").unlink(missing_ok=True)
    os.replace(tmp, target)
    return {**info, "seconds": time.perf_counter() - start}


async def usable(path: str, events: int) -> dict[str, Any]:
    """Whether the cached ledger at ``path`` opens with this code and holds ``events`` or more."""
    try:
        async with Ledger.open(f"sqlite+aiosqlite:///{path}", readonly=True) as ledger:
            head = await ledger.head()
    except LedgerError as error:
        return {"ok": False, "why": str(error)}
    return {"ok": head is not None and head.seq >= events, "why": f"head {head.seq if head else None}"}


def corpus(ctx: Context, sizes: list[int] | None = None) -> Path:
    """The recorded corpus of clusters of ``sizes`` (default 4, 16 and 64 servers; ``--quick``: 4
    only), recorded once per schema and recipe, cached."""
    sizes = [4] if ctx.quick else (sizes or [4, 16, 64])
    tag = "-".join(map(str, sizes)) + ("-quick" if ctx.quick else "")
    name = f"corpus-v{CORPUS_VERSION}-{HEAD_REVISION}-{tag}.db"
    path = ctx.cache / name
    if path.exists() and run_child("history:usable", {"path": str(path), "events": 1})["ok"]:
        return path
    ctx.log(f"  recording real cycles (sizes {sizes}) into {path}")
    work = ctx.work / "corpus"
    work.mkdir(exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    for leftover in path.parent.glob(tmp.name + "*"):
        leftover.unlink()
    params = {"path": str(tmp), "work": str(work), "sizes": sizes, "saves": 2 if ctx.quick else None}
    done = run_child("history:record_corpus", params,
                     timeout_s=1800)  # fmt: skip
    for suffix in ("-wal", "-shm", ".writer-lock"):
        Path(f"{tmp}{suffix}").unlink(missing_ok=True)
    os.replace(tmp, path)
    shutil.rmtree(work, ignore_errors=True)
    ctx.log(f"  recorded in {done['seconds']:.0f} s")
    return path


def history(ctx: Context, n: int, sizes: list[int] | None = None, rollouts: int = 0) -> Path:
    """The cached ``n``-event ledger built from the corpus of ``sizes`` (built when missing or
    refused); ``rollouts``: its lineage rotates through that many rollout ids (module docstring)."""
    source = corpus(ctx, sizes)
    rotated = f"-rollouts{rollouts}" if rollouts else ""
    path = ctx.cache / f"history-{n}{rotated}-b{BUILD_VERSION}-from-{source.stem}.db"
    if path.exists() and run_child("history:usable", {"path": str(path), "events": n})["ok"]:
        return path
    ctx.log(f"  building a {n:,}-event ledger from {source.name} in {path}")
    params = {"corpus": str(source), "path": str(path), "n": n, "rollouts": rollouts}
    done = run_child("history:build_history", params, timeout_s=3600)
    ctx.log(f"  built in {done['seconds']:.0f} s: {done['events']:,} events, {done['attempts']:,} attempts")
    return path


def copy_ledger(source: Path, folder: Path) -> Path:
    """A private copy of the ledger file ``source`` in ``folder`` (the cache stays untouched)."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "ledger.db"
    shutil.copyfile(source, target)
    return target


__all__ = ["build_history", "copy_ledger", "corpus", "crash_mid_save", "history", "record_corpus", "usable"]
