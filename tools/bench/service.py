"""Measure #10 — `quiesce serve`: a save through the service vs embedded, and a `/metrics` scrape.

**Save.** The 4-server reference cluster of #3 (``cycle.SPEC``: policy model at 20 ms per call,
an auxiliary judge, an agent, a resources server), a fresh one per run. One run (``run_saves``, a
fresh process) drives the same cluster two ways: embedded — ``Coordinator.save()`` in this process
on its own SQLite ledger — and through a real ``quiesce serve`` child process on another SQLite
ledger with ``RemoteCoordinator.save()`` (two requests: ``POST /v1/attempts``, then ``/publish``
with ``resume``). Both sides write the same small trainer file into the staging folder, and the
embedded side's ledger starts one epoch later, so the two sides' checkpoint ids never collide on
the servers. After one warm-up save each, ``CYCLES`` rounds of one save per side (the order flips
every round, each save after the same random settle time as #3) run twice (``MODES``): with the
servers idle, then with 4 rollouts running on the agent (as #3). The two saves of a round are
paired: the per-run medians of their differences and ratios give the milliseconds the service
adds per save and the ratio service / embedded. The goal (at most 5 ms) is judged idle: with
rollouts running, the drain a prepare waits for spreads a save over 70-320 ms, which 100 pairs
cannot resolve to a few milliseconds; that figure is reported beside it. Also reported: CPU per
save (embedded, the measuring process's; through the service, the service process's plus the
client's), and where the added time goes — the per-save times between the caller's clock and
the attempt's ledger timestamps (``PARTS``).

**Scrape.** One run (``run_scrape``, a fresh process) folds the events of ``ATTEMPTS`` recorded
attempts into a service's metrics through ``Metrics.observe`` and ``fold``, a thousand events at a
time — the path the coordinator's events take in a running service, which folds every
``WATCHDOG_S`` — then serves the service's app with uvicorn on loopback and times
``SCRAPES`` ``GET /metrics`` on one keep-alive connection by curl in its own process (httpx in this
one when curl is missing), with nothing changed since the previous scrape — what the goal judges:
counters and histograms are rendered once per change — and, on its own, the time to render them
again right after a change. The events are written to a real SQLite ledger and read back first: every tenth
attempt fails its resources commit and is rolled back, so failure labels and the rollback phase
are populated too. Goal: a scrape under 5 ms.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Final

import anyio
import httpx

from quiesce.coordinator import Coordinator, parse_config
from quiesce.coordinator.protocol import TOKEN_ENV
from quiesce.ledger import AppendItem, Event, Ledger
from quiesce.tools.audit.bench import attempt_items
from quiesce.tools.bench.cycle import SETTLE_JITTER_S, SETTLE_S, SPEC, cluster, start_rollouts
from quiesce.tools.bench.harness import Context, Result, Stats, child_env, process_cpu_s, run_child, stats_of
from quiesce.tools.serve.client import RemoteCoordinator
from quiesce.tools.serve.spawn import start_service

CYCLES: Final = 100
#: The servers idle, then with rollouts running (see the module docstring).
MODES: Final = ("idle", "rollouts")
ATTEMPTS: Final = 10_000
SCRAPES: Final = 200
GOAL_ADDED_MS: Final = 5.0
GOAL_SCRAPE_MS: Final = 5.0


# -- the save -------------------------------------------------------------------------------------


def _spawn_service(config: Path, token: str, log: Path) -> tuple[subprocess.Popen[str], str]:
    env = {**child_env(), TOKEN_ENV: token}
    env.pop("QUIESCE_API_TOKEN", None)
    process, announced = start_service(config, env, log)
    return process, str(announced["listening"])


async def _one_save(coord: Any, payload: bytes) -> tuple[str, float, tuple[float, float, float, float]]:
    """One save: its checkpoint id, its duration, and the wall-clock times (the ledger's clock)
    of its call, of the caller's block start and end, and of its return."""
    start = time.perf_counter()
    called = time.time()
    async with coord.save() as attempt:
        entered = time.time()
        (attempt.staging_dir / "trainer.bin").write_bytes(payload)
        left = time.time()
    returned = time.time()
    return attempt.checkpoint_id, time.perf_counter() - start, (called, entered, left, returned)


async def run_saves(
    config: dict[str, Any], token: str, cycles: int, dir: str, urls: dict[str, str]
) -> dict[str, Any]:
    """One run of the save measure (see the module docstring): ``cycles`` rounds with the servers
    idle, then the rollouts start and ``cycles`` rounds more."""
    folder = Path(dir)
    documents = {
        side: {**config, "ledger": f"sqlite+aiosqlite:///{folder / side}.db", "snapshots": str(folder / side)}
        for side in ("embedded", "service")
    }
    configs = {side: parse_config(document, base_dir=folder) for side, document in documents.items()}
    (folder / "service.yaml").write_text(json.dumps(documents["service"]), encoding="utf-8")  # JSON is YAML
    async with Coordinator.open(configs["embedded"], token=token, recover=False):
        pass  # the embedded side's epoch is then 2, the service's 1: their checkpoint ids differ
    process, url = _spawn_service(folder / "service.yaml", token, folder / "service.log")
    payload = os.urandom(4096)
    out: dict[str, Any] = {}
    saves: dict[str, list[tuple[str, tuple[float, float, float, float]]]] = {"embedded": [], "service": []}
    rng = random.Random()
    try:
        async with (
            Coordinator.open(configs["embedded"], token=token) as embedded,
            RemoteCoordinator(url, failover_s=60) as remote,
        ):
            sides = {"embedded": embedded, "service": remote}
            await embedded.discover()
            await remote.discover()
            for coord in sides.values():
                await _one_save(coord, payload)
            for mode in MODES:
                if mode == "rollouts":
                    await start_rollouts(urls, ["simple_agent"], 4, 1_000_000)
                took: dict[str, list[float]] = {"embedded": [], "service": []}
                cpu: dict[str, list[float]] = {"embedded": [], "service": []}
                for i in range(cycles):
                    settle_s = SETTLE_S + rng.random() * SETTLE_JITTER_S
                    for side in ("embedded", "service") if i % 2 == 0 else ("service", "embedded"):
                        await anyio.sleep(settle_s)
                        # CPU: this process's (embedded: the coordinator; service: the client), plus
                        # the service process's for a save through it
                        before = time.process_time(), process_cpu_s(process.pid)
                        checkpoint_id, seconds, times = await _one_save(sides[side], payload)
                        spent = time.process_time() - before[0]
                        if side == "service":
                            spent += process_cpu_s(process.pid) - before[1]
                        took[side].append(seconds)
                        cpu[side].append(spent)
                        if mode == "idle":
                            saves[side].append((checkpoint_id, times))
                pairs = list(zip(took["embedded"], took["service"], strict=True))
                out[mode] = {
                    "embedded_s": statistics.median(took["embedded"]),
                    "service_s": statistics.median(took["service"]),
                    # paired: the two saves of a round follow the same settle time, back to back
                    "ratio": statistics.median(s / e for e, s in pairs),
                    "added_s": statistics.median(s - e for e, s in pairs),
                    # means: the service process's CPU is read in clock ticks (10 ms): only a sum is exact
                    "embedded_cpu_s": statistics.fmean(cpu["embedded"]),
                    "service_cpu_s": statistics.fmean(cpu["service"]),
                }
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    for side in configs:
        out[f"{side}_parts"] = await _parts(configs[side].ledger, saves[side])
    return out


#: Where a save's time goes outside the coordinator's own work, from the caller's clock and the
#: ledger's timestamps (one clock: this machine's): until the attempt's first event, from the end
#: of commit to the caller's block, from the block to publish's start, and from the attempt's
#: last event to the caller.
PARTS: Final = ("in", "out_after_commit", "in_publish", "out_at_end")


async def _parts(url: str, saves: list[tuple[str, tuple[float, float, float, float]]]) -> dict[str, float]:
    """Medians of ``PARTS`` over ``saves`` (seconds)."""
    from datetime import datetime

    marks: dict[str, dict[str, float]] = {}
    async with Ledger.open(url, readonly=True) as ledger:
        async for event in ledger.read():
            if event.checkpoint_id is None:
                continue
            at = datetime.fromisoformat(event.at).timestamp()
            mark = marks.setdefault(event.checkpoint_id, {"first": at})
            mark["last"] = at
            if event.kind == "phase.completed" and event.data.get("phase") == "commit":
                mark["commit_end"] = at
            elif event.kind == "phase.started" and event.data.get("phase") == "publish":
                mark["publish_start"] = at
    parts: dict[str, list[float]] = {name: [] for name in PARTS}
    for checkpoint_id, (called, entered, left, returned) in saves:
        mark = marks[checkpoint_id]
        parts["in"].append(mark["first"] - called)
        parts["out_after_commit"].append(entered - mark["commit_end"])
        parts["in_publish"].append(mark["publish_start"] - left)
        parts["out_at_end"].append(returned - mark["last"])
    return {name: statistics.median(values) for name, values in parts.items()}


# -- the scrape ----------------------------------------------------------------------------------


def _failed_attempt_items(n: int) -> list[AppendItem]:
    """A save whose resources commit failed (HTTP 500) and was rolled back."""
    items = attempt_items(n)
    cid = f"e1-{n:07d}"
    cut = next(
        i for i, item in enumerate(items) if item.kind == "call.sent" and str(item.data["path"]).endswith(
            "/resources-checkpoint/commit")
    )  # fmt: skip
    sent = items[cut]
    return [
        *items[: cut + 1],
        AppendItem(
            "call.failed",
            cid,
            sent.server,
            sent.call_id,
            {
                "error": "http",
                "status": 500,
                "code": "injected_fault",
                "detail": "injected",
                "elapsed_s": 0.02,
            },
        ),
        AppendItem("phase.failed", cid, data={"phase": "commit", "server": sent.server, "reason": "500"}),
        AppendItem("attempt.aborting", cid, data={"reason": "commit failed"}),
        AppendItem("attempt.aborted", cid, data={"reason": "commit failed", "resumed": ["tools"]}),
    ]


async def run_scrape(attempts: int, scrapes: int, dir: str) -> dict[str, Any]:
    """One run of the scrape measure (see the module docstring)."""
    import socket

    import uvicorn

    from quiesce.tools.serve.app import build_app
    from quiesce.tools.serve.runner import _Server
    from quiesce.tools.serve.service import Service

    folder = Path(dir)
    url = f"sqlite+aiosqlite:///{folder / 'scrape.db'}"
    async with Ledger.open(url, durability="process") as ledger:
        await ledger.start_epoch(
            {"coordinator": {"host": "bench", "pid": 0, "uuid": "bench"}, "version": "bench"}
        )
        batch: list[AppendItem] = []
        for n in range(attempts):
            batch.extend(_failed_attempt_items(n) if n % 10 == 9 else attempt_items(n))
            if len(batch) >= 5000:
                await ledger.append_many(batch)
                batch = []
        if batch:
            await ledger.append_many(batch)
    config = parse_config(
        {
            "ledger": url,
            "snapshots": str(folder / "snaps"),
            "servers": [{"name": "m", "url": "http://127.0.0.1:9"}],
        },
        base_dir=folder,
    )
    service = Service(config, advertise="http://127.0.0.1:0")
    events = 0
    async with Ledger.open(url, readonly=True) as reader:
        page: list[Any] = []
        async for event in reader.read():
            page.append(event)
            if len(page) >= 1000:
                # folded page by page, as a running service folds every WATCHDOG_S: holding every
                # event until one fold would measure this harness's memory, not the service's
                service.metrics.observe(page)
                service.metrics.fold()
                events += len(page)
                page = []
        service.metrics.observe(page)
        events += len(page)
    service.metrics.fold()
    recorded = sum(
        sample.value
        for family in service.metrics.registry.collect()
        if family.name == "quiesce_attempts"
        for sample in family.samples
        if sample.name == "quiesce_attempts_total"
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # see runner.serve
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    port = sock.getsockname()[1]
    server = _Server(uvicorn.Config(build_app(service, api_token=None), log_level="warning", access_log=False,
                                    lifespan="off"))  # fmt: skip
    changed: list[float] = []
    nudge = [Event(0, "2000-01-01T00:00:00.000000Z", "coordinator.started", None, None, None, 1, {}, "", "")]
    for _ in range(scrapes):
        service.metrics.observe(nudge)  # a change that counts nothing: the next scrape renders anew
        start = time.perf_counter()
        service.metrics.fold()
        service.metrics.scrape()
        changed.append(time.perf_counter() - start)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        while not server.started:  # noqa: ASYNC110  # uvicorn has no event for it
            await anyio.sleep(0.01)
        idle, size, scraper = await _scrape_over_http(f"http://127.0.0.1:{port}/metrics", scrapes)
        server.should_exit = True
    sock.close()
    return {
        "scrape_s": statistics.median(idle),
        "render_s": statistics.median(changed),
        "bytes": size,
        "attempts": recorded,
        "events": events,
        "scraper": scraper,
    }


async def _scrape_over_http(url: str, scrapes: int) -> tuple[list[float], int, str]:
    """Seconds of each of `scrapes` GETs on one keep-alive connection, the body size, and the client:
    curl in its own process (a scraper's view: the server is not slowed by the client sharing its
    loop) when installed, else httpx in this process (client time included)."""
    import shutil

    curl = shutil.which("curl")
    if curl is not None:
        done = await anyio.run_process(
            [
                curl,
                "-s",
                "-w",
                "%{time_total} %{size_download}\\n",
                *(["-o", "/dev/null", url] * (scrapes + 5)),
            ]
        )  # one `-o` per URL: curl writes only the first one's body where a lone `-o` says
        rows = [line.split() for line in done.stdout.decode().splitlines() if line.strip()]
        return [float(t) for t, _ in rows[5:]], int(rows[-1][1]), "curl (keep-alive)"
    times: list[float] = []
    size = 0
    async with httpx.AsyncClient(trust_env=False) as http:
        for index in range(scrapes + 5):
            start = time.perf_counter()
            reply = await http.get(url)
            if index >= 5:
                times.append(time.perf_counter() - start)
            size = len(reply.content)
    return times, size, "httpx in the same process"


# -- the measure --------------------------------------------------------------------------------


def measure(ctx: Context) -> Result:
    """Measure #10 (see the module docstring)."""
    cycles = 2 if ctx.quick else CYCLES
    attempts = 200 if ctx.quick else ATTEMPTS
    result = Result(
        10,
        "quiesce serve: 4-server save through the service vs embedded; /metrics scrape",
        f"service adds <= {GOAL_ADDED_MS:g} ms per save; scrape < {GOAL_SCRAPE_MS:g} ms at 10,000 attempts",
    )
    token = "bench-" + secrets.token_hex(8)
    saves: list[dict[str, Any]] = []
    for index in range(ctx.runs):
        with cluster(SPEC, token, ctx.work) as running:
            folder = ctx.work / f"serve-{index}"
            folder.mkdir()
            params = {"config": running.config(), "token": token, "cycles": cycles, "dir": str(folder),
                      "urls": running.urls}  # fmt: skip
            saves.append(run_child("service:run_saves", params))
        last = saves[-1]
        ctx.log(f"  run {index + 1}/{ctx.runs}: "
                + "; ".join(f"{mode}: embedded {last[mode]['embedded_s'] * 1e3:.1f} ms, service"
                            f" {last[mode]['service_s'] * 1e3:.1f} ms (+{last[mode]['added_s'] * 1e3:.2f} ms)"
                            for mode in MODES))  # fmt: skip
    scrapes: list[dict[str, Any]] = []
    for index in range(ctx.runs):
        folder = ctx.work / f"scrape-{index}"
        folder.mkdir()
        scrapes.append(
            run_child("service:run_scrape", {"attempts": attempts, "scrapes": SCRAPES, "dir": str(folder)})
        )
        ctx.log(f"  scrape run {index + 1}/{ctx.runs}: {scrapes[-1]['scrape_s'] * 1e3:.2f} ms")

    def of(mode: str, key: str) -> Stats:
        return Stats.of([run[mode][key] for run in saves])

    idle, busy = (
        {k: of("idle", k) for k in saves[0]["idle"]},
        {k: of("rollouts", k) for k in saves[0]["rollouts"]},
    )
    scrape, size = stats_of(scrapes, "scrape_s"), stats_of(scrapes, "bytes")
    render = stats_of(scrapes, "render_s")
    result.runs = len(saves)
    for key, stats in idle.items():
        result.metric(key, stats, "x" if key == "ratio" else "s")
    for key, stats in busy.items():
        result.metric(f"rollouts_{key}", stats, "x" if key == "ratio" else "s")
    result.metric("scrape_s", scrape, "s")
    result.metric("render_s", render, "s")
    result.metric("scrape_bytes", size, "bytes")
    result.metric("peak_rss_mb", stats_of(saves + scrapes, "peak_rss_mb"), "MB")
    result.value = (
        f"service adds {idle['added_s'].fmt(1e3, 2, 'ms')} per save (ratio {idle['ratio'].fmt(1, 3)}),"
        f" servers idle; with rollouts running {busy['added_s'].fmt(1e3, 2, 'ms')}"
        f" (ratio {busy['ratio'].fmt(1, 3)});"
        f" /metrics scrape {scrape.fmt(1e3, 2, 'ms')} at {int(scrapes[0]['attempts']):,} attempts"
        f" (+{render.fmt(1e3, 2, 'ms')} to render again right after a change)"
    )
    result.baseline = (
        f"embedded save {idle['embedded_s'].fmt(1e3, 1, 'ms')}, through the service"
        f" {idle['service_s'].fmt(1e3, 1, 'ms')} (idle); with rollouts {busy['embedded_s'].fmt(1e3, 1, 'ms')}"
        f" and {busy['service_s'].fmt(1e3, 1, 'ms')}"
    )
    result.met = idle["added_s"].median * 1e3 <= GOAL_ADDED_MS and scrape.median * 1e3 < GOAL_SCRAPE_MS
    result.side(
        "embedded (Coordinator in the bench process)",
        durability="full (SQLite WAL, its own ledger file in the same folder)",
        transport="coordinator to Gym: loopback HTTP, coordinator/http.py; caller to coordinator: a call",
        order="alternating: even rounds embedded first, odd rounds service first; same cluster, same settle",
    )
    result.side(
        "service (quiesce serve in its own process, RemoteCoordinator)",
        durability="the same",
        transport="the same to Gym; caller to coordinator: loopback HTTP (coordinator/http.py), 2 requests"
        " per save",
        order="the same",
    )
    result.notes.append(
        "judged with the servers idle: with 4 rollouts running, the drain a prepare waits for spreads one"
        " save over about 70-320 ms, so a run's 100 paired differences cannot resolve a few milliseconds (the"
        " rollouts figure moves by about +-8 ms from run to run); idle, the same saves on the same cluster"
        " spread over about 40-90 ms. Both are reported, from the same runs, same service process"
    )
    result.notes.append(
        f"CPU per save (a run's mean), idle: embedded {idle['embedded_cpu_s'].fmt(1e3, 1, 'ms')} (the"
        f" coordinator, in the measuring process); through the service"
        f" {idle['service_cpu_s'].fmt(1e3, 1, 'ms')} (service process + client)"
    )
    parts = {side: {name: Stats.of([run[f"{side}_parts"][name] for run in saves]) for name in PARTS}
             for side in ("embedded", "service")}  # fmt: skip
    for side, named in parts.items():
        for name, stats in named.items():
            result.metric(f"{side}_{name}_s", stats, "s")
    labels = {
        "in": "call to the attempt's first event",
        "out_after_commit": "commit's end to the caller's block",
        "in_publish": "the block's end to publish's start",
        "out_at_end": "the attempt's last event to the return",
    }
    result.notes.append(
        "where the added time goes (idle; medians of the per-save times between the caller's clock and the"
        " ledger's timestamps): "
        + "; ".join(
            f"{labels[name]}: embedded {parts['embedded'][name].fmt(1e3, 2, 'ms')}, service"
            f" {parts['service'][name].fmt(1e3, 2, 'ms')}"
            for name in PARTS
        )
        + ". The last part includes the deletion of a snapshot that retention removed, which a save waits"
        " for (it runs beside the resume), on both sides"
    )
    result.notes.append(
        f"{cycles} measured rounds per mode per run (one save per side, order flipped every round) after one"
        " warm-up each; 'adds' and the ratio are the medians over a run's rounds of the paired difference"
        " and ratio; each save writes a 4 KiB trainer file into the staging folder; the service is a real"
        " `quiesce serve` process on its own SQLite ledger, driven by `RemoteCoordinator.save()` (two"
        " requests); the embedded side is `Coordinator.save()` in the measuring process"
    )
    result.notes.append(
        f"scrape: {SCRAPES} `GET /metrics` per run after 5 warm-up ones on one keep-alive connection, by"
        f" {scrapes[0]['scraper']}, with nothing changed since the previous scrape: counters and histograms"
        " are rendered once per change (the goal is judged on this: Prometheus scrapes every few seconds,"
        " attempts come minutes apart); rendering them again after a change is timed on its own, in"
        " process (the client library's renderer: tens of microseconds per line on this VM);"
        f" the metrics folded {Stats.of([s['events'] for s in scrapes]).median:,.0f} events of"
        f" {int(scrapes[0]['attempts']):,} attempts (every tenth rolled back); the page is"
        f" {size.median / 1024:.1f} KiB"
    )
    return result
