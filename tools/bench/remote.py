"""Measure #2 — a recorded remote call vs a DBOS workflow of one step, at equal durability and transport.

Both sides run on SQLite in WAL mode, on the same disk, against the same tiny uvicorn server on
loopback (``quiesce.tools.bench.tinyserver``, its own process), and send the same
``POST /ng-control/v1/agent-checkpoint/prepare`` with the same HTTP client code
(``coordinator/http.py``; the DBOS venv loads that file by path). Two durability settings:

- **fsync per step**: quiesce appends ``call.sent`` and ``call.replied`` durably (durability
  "full": the WAL fdatasynced after each — 2 fsyncs per call); DBOS runs with SQLite's default
  ``synchronous=FULL`` (the WAL fsynced at every commit; its commits per workflow are counted).
- **fsync off**: quiesce's real ``Caller`` on durability "process"; DBOS with ``synchronous=OFF``.

and two transports: the POST, or none (DBOS: a no-op step; quiesce: the same ledger work with no
request). quiesce as shipped — the real ``Caller`` on durability "full", which makes no fsync per
call (``call.sent`` write-behind, the reply staged: both on disk with the next durable record) —
is reported beside them and not judged. The goal: DBOS / quiesce >= 3 on all four pairs.

Each run is three fresh processes in a rotating order: quiesce (``run_quiesce``: its five kinds of
call interleaved, rotating), DBOS at ``FULL`` and DBOS at ``OFF`` (``dbos_child.py``, run by a venv
the bench creates with ``pip install dbos anyio httptools``; DBOS is never a dependency of
quiesce). When the venv cannot be built the measure is ``unavailable`` with pip's reason; the
quiesce side is still reported.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path
from typing import Any

from quiesce.coordinator.calls import MAX_REPLY_BYTES, Caller, Target
from quiesce.coordinator.http import HttpClient
from quiesce.coordinator.protocol import AGENT, AgentPrepareReply, CommonBody, route
from quiesce.ledger import Ledger
from quiesce.tools.bench.harness import (
    REPO_ROOT,
    BenchError,
    Context,
    Result,
    Stats,
    child_env,
    run_child,
    stats_of,
)

TOKEN = "bench-token"
PATH = route(AGENT, "prepare").full_path
HERE = Path(__file__).resolve().parent
#: What ``tinyserver`` answers, recorded as the reply body when no request is made (transport none).
REPLY_BODY: dict[str, Any] = {
    "state": "prepared",
    "ready_to_commit": True,
    "running": 0,
    "parked": 3,
    "active": 3,
}
#: The DBOS venv's packages: DBOS itself, and what ``coordinator/http.py`` needs (the same transport).
DBOS_PACKAGES = ("dbos>=3", "anyio", "httptools")


async def run_quiesce(url: str, n: int, dir: str) -> dict[str, Any]:
    """One run of the quiesce side: ``n`` rounds (after 10% warm-up) of five kinds of call, rotating.

    ``fsync_http``: ``call.sent`` appended durably, the POST, the reply validated, ``call.replied``
    appended durably (durability "full": the WAL fdatasynced after each, 2 fsyncs per call);
    ``fsync_none``: the same two durable appends with no request between them; ``off_http``: the
    real ``Caller`` on a ledger with durability "process" (never fsynced); ``off_none``: its ledger
    work alone (``call.sent`` appended write-behind, ``call.replied`` staged); ``shipped_http``:
    the real ``Caller`` on durability "full" as shipped (``call.sent`` write-behind, the reply
    staged: no fsync per call — the next durable record makes them durable). Each kind's median.
    """
    folder = Path(tempfile.mkdtemp(prefix="remote-", dir=dir))
    http = HttpClient()
    took: dict[str, list[float]] = {
        k: [] for k in ("fsync_http", "fsync_none", "off_http", "off_none", "shipped_http")
    }
    try:
        async with (
            Ledger.open(f"sqlite+aiosqlite:///{folder / 'full.db'}", secrets=[TOKEN]) as full,
            Ledger.open(
                f"sqlite+aiosqlite:///{folder / 'process.db'}", secrets=[TOKEN], durability="process"
            ) as process,
        ):
            coordinator = {"coordinator": {"host": "bench", "pid": os.getpid(), "uuid": "u"}, "version": "b"}
            deadline = time.time() + 3600
            for ledger in (full, process):
                await ledger.start_epoch(coordinator)
            cid = {id(ledger): f"e{ledger.epoch}-000002" for ledger in (full, process)}
            for ledger in (full, process):
                await ledger.append(
                    "attempt.started",
                    checkpoint_id=cid[id(ledger)],
                    data={"kind": "save", "deadline_ts": deadline, "participants": ["agent"]},
                )
            target = Target("agent", AGENT, url)
            callers = {
                "off": Caller(process, TOKEN, epoch=process.epoch, client=http),
                "shipped": Caller(full, TOKEN, epoch=full.epoch, client=http),
            }
            bodies = {
                key: CommonBody(checkpoint_id=cid[id(ledger)], deadline_ts=deadline)
                for key, ledger in (("off", process), ("shipped", full))
            }
            body = bodies["shipped"]
            payload = json.dumps(body.model_dump(mode="json")).encode()
            headers = {
                "Authorization": f"Bearer {TOKEN}",
                "Accept": "application/json",
                "Content-Type": "application/json",
            }
            sent = {
                "phase": "prepare",
                "method": "POST",
                "path": PATH,
                "url": url + PATH,
                "timeout_s": 30.0,
                "body": body.model_dump(mode="json"),
            }
            counter = itertools.count()

            async def by_caller(key: str) -> None:
                result = await callers[key].call(
                    target,
                    route(AGENT, "prepare"),
                    phase="prepare",
                    checkpoint_id=bodies[key].checkpoint_id,
                    deadline_ts=deadline,
                    body=bodies[key],
                )
                if not result.ok:
                    raise BenchError(f"recorded call failed: {result.describe()}")

            async def two_appends(ledger: Ledger, durable: bool, with_http: bool) -> None:
                call_id = f"b{next(counter)}"
                checkpoint_id = cid[id(ledger)]
                await ledger.append(
                    "call.sent",
                    checkpoint_id=checkpoint_id,
                    server="agent",
                    call_id=call_id,
                    data=sent,
                    durable=durable,
                )
                started = time.monotonic()
                reply_body: Any = REPLY_BODY
                if with_http:
                    reply = await http.request(
                        "POST",
                        url + PATH,
                        headers=headers,
                        body=payload,
                        timeout_s=30,
                        max_body=MAX_REPLY_BYTES,
                    )
                    if reply.status != 200:
                        raise BenchError(f"bare call failed: HTTP {reply.status}")
                    reply_body = json.loads(reply.body)
                    AgentPrepareReply.model_validate(reply_body)
                data = {"status": 200, "body": reply_body, "elapsed_s": time.monotonic() - started}
                if durable:
                    await ledger.append(
                        "call.replied",
                        checkpoint_id=checkpoint_id,
                        server="agent",
                        call_id=call_id,
                        data=data,
                    )
                else:
                    await ledger.stage(
                        "call.replied",
                        checkpoint_id=checkpoint_id,
                        server="agent",
                        call_id=call_id,
                        data=data,
                    )

            kinds = {
                "fsync_http": lambda: two_appends(full, True, True),
                "fsync_none": lambda: two_appends(full, True, False),
                "off_http": lambda: by_caller("off"),
                "off_none": lambda: two_appends(process, False, False),
                "shipped_http": lambda: by_caller("shipped"),
            }
            names = list(kinds)
            warm = max(1, n // 10)
            for i in range(n + warm):
                shift = i % len(names)  # rotate: each kind runs first, second, ... in turn
                for name in names[shift:] + names[:shift]:
                    start = time.perf_counter()
                    await kinds[name]()
                    elapsed = time.perf_counter() - start
                    if i >= warm:
                        took[name].append(elapsed)
            for caller in callers.values():
                await caller.aclose()
    finally:
        await http.aclose()
        shutil.rmtree(folder, ignore_errors=True)
    return {f"{name}_s": statistics.median(values) for name, values in took.items()}


class _TinyServer:
    """``quiesce.tools.bench.tinyserver`` in its own process."""

    def __init__(self, work: Path) -> None:
        self.port_file = work / "tinyserver.port"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "quiesce.tools.bench.tinyserver", str(self.port_file)],
            cwd=str(REPO_ROOT),  # `-m` finds this tree's `tools` by location, whatever the caller's cwd
            env=child_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        give_up = time.monotonic() + 30
        while not self.port_file.exists():
            if self.process.poll() is not None or time.monotonic() > give_up:
                self.stop()
                raise BenchError("the tiny loopback server did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port_file.read_text().strip()}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _venv_python(folder: Path) -> Path:
    return folder / "bin" / "python"


def build_dbos_venv(folder: Path, log: Any) -> tuple[Path | None, str | None]:
    """Create (or reuse) a venv with ``DBOS_PACKAGES``; (python, None) or (None, why not)."""
    python = _venv_python(folder)
    check = [str(python), "-c", "import dbos, anyio, httptools"]
    if python.exists() and subprocess.run(check, capture_output=True, check=False).returncode == 0:
        return python, None
    log(f"  creating the DBOS venv in {folder} (pip install {' '.join(DBOS_PACKAGES)})")
    try:
        venv.EnvBuilder(with_pip=True, clear=True).create(folder)
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *DBOS_PACKAGES],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"could not build the DBOS venv: {error}"
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip() and "WARNING" not in ln]
        return None, "pip install dbos failed: " + (" / ".join(lines[-3:]) or f"exit {done.returncode}")
    return python, None


def _run_dbos(python: Path, url: str, n: int, work: Path, synchronous: str) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="dbos-", dir=work))
    script = HERE / "dbos_child.py"
    args = json.dumps(
        {
            "db": str(folder / "dbos.sqlite"),
            "url": url + PATH,
            "n": n,
            "synchronous": synchronous,
            "http_module": str(REPO_ROOT / "coordinator" / "http.py"),
        }
    )
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [str(python), "-c", f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')", args],
            cwd=str(folder),
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if done.returncode != 0:
        raise BenchError("the DBOS child failed:\n" + "\n".join(done.stderr.splitlines()[-10:]))
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    return result


#: (setting, quiesce kind, DBOS synchronous, DBOS figure, transport) of each judged ratio.
PAIRS = (
    ("fsync per step", "fsync_http", "FULL", "dbos_http_best_s", "loopback HTTP"),
    ("fsync per step", "fsync_none", "FULL", "dbos_noop_best_s", "none"),
    ("fsync off", "off_http", "OFF", "dbos_http_best_s", "loopback HTTP"),
    ("fsync off", "off_none", "OFF", "dbos_noop_best_s", "none"),
)


def measure(ctx: Context) -> Result:
    """Measure #2 (see the module docstring): each run is three fresh processes, one per side, in
    a rotating order — quiesce, DBOS with ``synchronous=FULL``, DBOS with ``synchronous=OFF``."""
    n = 20 if ctx.quick else 200
    result = Result(
        2,
        "recorded remote call vs DBOS, equal durability and transport",
        "DBOS workflow (one step) >= 3x the quiesce recorded call, at equal durability and transport",
    )
    server = _TinyServer(ctx.work)
    try:
        python: Path | None = None
        reason: str | None = None
        venv_dir: Path | None = None
        if ctx.quick and ctx.dbos_venv is None:
            reason = "skipped with --quick (pass --dbos-venv DIR to include DBOS)"
        else:
            venv_dir = ctx.dbos_venv or Path(tempfile.mkdtemp(prefix="dbos-venv-"))
            python, reason = build_dbos_venv(venv_dir, ctx.log)
        ours: list[dict[str, Any]] = []
        theirs: dict[str, list[dict[str, Any]]] = {"FULL": [], "OFF": []}
        try:
            for index in range(ctx.runs):
                sides = ["quiesce", "FULL", "OFF"] if python is not None else ["quiesce"]
                shift = index % len(sides)
                for side in sides[shift:] + sides[:shift]:
                    if side == "quiesce":
                        ours.append(
                            run_child("remote:run_quiesce", {"url": server.url, "n": n, "dir": str(ctx.work)})
                        )
                    else:
                        assert python is not None
                        theirs[side].append(_run_dbos(python, server.url, n, ctx.work, side))
                ctx.log(f"  run {index + 1}/{ctx.runs} done")
        finally:
            if venv_dir is not None and ctx.dbos_venv is None:
                shutil.rmtree(venv_dir, ignore_errors=True)
    finally:
        server.stop()
    result.runs = len(ours)
    labels = {
        "fsync_http": "quiesce, fsync per step: durable call.sent, POST, reply validated, durable reply",
        "fsync_none": "quiesce, fsync per step, no request: two durable appends",
        "off_http": "quiesce, fsync off: the real Caller on durability process",
        "off_none": "quiesce, fsync off, no request: call.sent appended write-behind, call.replied staged",
        "shipped_http": "quiesce as shipped (durability full): the real Caller; call.sent write-behind, reply"
        " staged, both on disk with the next durable record (no fsync per call)",
    }
    rows: list[dict[str, str]] = []
    for kind, label in labels.items():
        figure = stats_of(ours, f"{kind}_s")
        result.metric(f"quiesce_{kind}_s", figure, "s")
        rows.append({"per call": label, "median [min–max]": figure.fmt(1e3, 3, "ms")})
    result.metric("peak_rss_mb", stats_of(ours, "peak_rss_mb"), "MB")
    result.side(
        "quiesce",
        durability="fsync per step: full, both appends durable (2 WAL fdatasyncs per call);"
        " fsync off: durability process",
        transport="loopback HTTP with coordinator/http.py, or none",
        order="five kinds of call interleaved, rotating; the three processes of a run rotate",
    )
    if python is None:
        result.status = "unavailable"
        recorded = stats_of(ours, "fsync_http_s")
        result.reason = (
            f"DBOS baseline unavailable: {reason}; quiesce (fsync per step): {recorded.fmt(1e3, 3, 'ms')}"
        )
        result.rows = rows
        return result
    for sync in ("FULL", "OFF"):
        runs = theirs[sync]
        setting = "fsync per step" if sync == "FULL" else "fsync off"
        for key, api, transport in (
            ("http", "async", "loopback HTTP"),
            ("http_sync", "sync", "loopback HTTP"),
            ("noop", "async", "none"),
            ("noop_sync", "sync", "none"),
        ):
            figure = stats_of(runs, f"dbos_{key}_s")
            result.metric(f"dbos_{sync.lower()}_{key}_s", figure, "s")
            rows.append(
                {
                    "per call": f"DBOS {setting} (synchronous={sync}), {api} API, one step, transport"
                    f" {transport}; {runs[0][f'commits_{key}']:.0f} commits per workflow",
                    "median [min–max]": figure.fmt(1e3, 3, "ms"),
                }
            )
    ratios: dict[tuple[str, str], Stats] = {}
    for setting, kind, sync, figure_key, transport in PAIRS:
        values = [d[figure_key] / q[f"{kind}_s"] for q, d in zip(ours, theirs[sync], strict=True)]
        ratios[(setting, transport)] = Stats.of(values)
        result.metric(f"ratio_{kind}", Stats.of(values), "x")
    version = theirs["FULL"][0].get("dbos_version")
    fsync_http = stats_of(ours, "fsync_http_s")
    off_http = stats_of(ours, "off_http_s")
    result.value = (
        f"fsync per step: {fsync_http.fmt(1e3, 3, 'ms')} per recorded call, DBOS/quiesce"
        f" {ratios[('fsync per step', 'loopback HTTP')].fmt(1, 2)}x; fsync off: {off_http.fmt(1e3, 3, 'ms')},"
        f" {ratios[('fsync off', 'loopback HTTP')].fmt(1, 2)}x (same HTTP client; with no request:"
        f" {ratios[('fsync per step', 'none')].median:.2f}x and {ratios[('fsync off', 'none')].median:.2f}x)"
    )
    dbos_full, dbos_off = (
        stats_of(theirs["FULL"], "dbos_http_best_s"),
        stats_of(theirs["OFF"], "dbos_http_best_s"),
    )
    result.baseline = (
        f"DBOS {version}, one step making the same POST (faster of its sync and async APIs):"
        f" {dbos_full.fmt(1e3, 3, 'ms')}"
        f" (synchronous=FULL), {dbos_off.fmt(1e3, 3, 'ms')} (OFF)"
    )
    result.met = min(stats.median for stats in ratios.values()) >= 3.0
    result.metric("dbos_peak_rss_mb", stats_of(theirs["FULL"] + theirs["OFF"], "peak_rss_mb"), "MB")
    result.side(
        "DBOS",
        durability="fsync per step: SQLite synchronous=FULL (WAL fsynced at every commit);"
        " fsync off: synchronous=OFF",
        transport="the same: coordinator/http.py loaded in the DBOS venv, or none (no-op step)",
        order="four workflows (sync and async API x two transports) interleaved, rotating; the faster API is"
        " compared (the sync one runs on one worker thread: a thread hop per call)",
    )
    result.rows = rows
    result.notes.append(
        f"{n} calls per run and kind after a 10% warm-up; both system databases are SQLite files in WAL mode"
        " on the same disk; the goal is judged on all four pairs (two durability settings x two transports);"
        " 'as shipped' is reported, not judged: it makes no fsync per call"
    )
    return result
