"""Measure #2 — one recorded remote call vs DBOS running one durable step per call, both on SQLite.

quiesce side (``run_quiesce``, a fresh process per run): the real ``coordinator.calls.Caller``
makes ``POST /ng-control/v1/agent-checkpoint/prepare`` to a tiny uvicorn server on loopback
(``tools.bench.tinyserver``, its own process): ``call.sent`` appended durably (WAL, fdatasynced
after the commit), the HTTP call, the reply validated, ``call.replied`` appended durably.
Interleaved with it, the bare HTTP call (same client, nothing recorded).

DBOS side (``dbos_child.py``, run by a throwaway venv that the bench creates under a temp dir
with ``pip install dbos httpx``; DBOS is never a dependency of quiesce): a DBOS workflow with
one durable no-op step per call (the issue's baseline), a workflow whose one step makes the same
HTTP call (like for like), and the bare HTTP call; system database on SQLite in WAL mode.

The goal compares the median per call: DBOS workflow with a no-op step / quiesce recorded call
>= 3. When the venv cannot be built (no network, no wheel), the measure is ``unavailable`` with
pip's reason; the quiesce side is still reported.
"""

from __future__ import annotations

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

from coordinator.calls import MAX_REPLY_BYTES, Caller, Target
from coordinator.http import HttpClient
from coordinator.protocol import AGENT, CommonBody, route
from ledger import Ledger
from tools.bench.harness import (
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


async def run_quiesce(url: str, n: int, dir: str) -> dict[str, Any]:
    """``n`` recorded calls interleaved with ``n`` bare calls (after 10% warm-up); their medians."""
    folder = Path(tempfile.mkdtemp(prefix="remote-", dir=dir))
    recorded: list[float] = []
    bare: list[float] = []
    http = HttpClient()
    try:
        async with Ledger.open(f"sqlite+aiosqlite:///{folder / 'ledger.db'}", secrets=[TOKEN]) as ledger:
            await ledger.start_epoch({"coordinator": {"host": "bench", "pid": os.getpid(), "uuid": "u"},
                                      "version": "bench"})  # fmt: skip
            caller = Caller(ledger, TOKEN, epoch=ledger.epoch, client=http)
            target = Target("agent", AGENT, url)
            checkpoint_id = f"e{ledger.epoch}-000002"
            await ledger.append(
                "attempt.started",
                checkpoint_id=checkpoint_id,
                data={"kind": "save", "deadline_ts": time.time() + 3600, "participants": ["agent"]},
            )
            body = CommonBody(checkpoint_id=checkpoint_id, deadline_ts=time.time() + 3600)
            plain = body.model_dump(mode="json")
            headers = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/json",
                       "Content-Type": "application/json"}  # fmt: skip
            warm = max(1, n // 10)
            for i in range(n + warm):
                start = time.perf_counter()
                result = await caller.call(
                    target,
                    route(AGENT, "prepare"),
                    phase="prepare",
                    checkpoint_id=checkpoint_id,
                    deadline_ts=body.deadline_ts,
                    body=body,
                )
                recorded_s = time.perf_counter() - start
                if not result.ok:
                    raise BenchError(f"recorded call failed: {result.describe()}")
                start = time.perf_counter()
                payload = json.dumps(plain).encode()
                reply = await http.request(
                    "POST", url + PATH, headers=headers, body=payload, timeout_s=30, max_body=MAX_REPLY_BYTES
                )
                if reply.status != 200:
                    raise BenchError(f"bare call failed: HTTP {reply.status}")
                json.loads(reply.body)
                bare_s = time.perf_counter() - start
                if i >= warm:
                    recorded.append(recorded_s)
                    bare.append(bare_s)
    finally:
        await http.aclose()
        shutil.rmtree(folder, ignore_errors=True)
    return {"recorded_s": statistics.median(recorded), "bare_async_s": statistics.median(bare)}


class _TinyServer:
    """``tools.bench.tinyserver`` in its own process."""

    def __init__(self, work: Path) -> None:
        self.port_file = work / "tinyserver.port"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tools.bench.tinyserver", str(self.port_file)],
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
    """Create (or reuse) a venv with ``dbos`` and ``httpx``; (python, None) or (None, why not)."""
    python = _venv_python(folder)
    check = [str(python), "-c", "import dbos, httpx"]
    if python.exists() and subprocess.run(check, capture_output=True, check=False).returncode == 0:
        return python, None
    log(f"  creating the DBOS venv in {folder} (pip install dbos httpx)")
    try:
        venv.EnvBuilder(with_pip=True, clear=True).create(folder)
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "dbos>=3", "httpx"],
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


def _run_dbos(python: Path, url: str, n: int, work: Path) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="dbos-", dir=work))
    script = HERE / "dbos_child.py"
    args = f'{{"db": "{folder / "dbos.sqlite"}", "url": "{url + PATH}", "n": {n}}}'
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


def measure(ctx: Context) -> Result:
    """Measure #2 (see the module docstring): runs alternate quiesce / DBOS, one process each."""
    n = 20 if ctx.quick else 200
    result = Result(
        2,
        "recorded remote call (append, loopback HTTP, append) vs DBOS",
        "DBOS workflow with one durable no-op step per call >= 3x the quiesce recorded call",
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
        theirs: list[dict[str, Any]] = []
        try:
            for index in range(ctx.runs):
                params = {"url": server.url, "n": n, "dir": str(ctx.work)}
                ours.append(run_child("remote:run_quiesce", params))
                if python is not None:
                    theirs.append(_run_dbos(python, server.url, n, ctx.work))
                ctx.log(f"  run {index + 1}/{ctx.runs} done")
        finally:
            if venv_dir is not None and ctx.dbos_venv is None:
                shutil.rmtree(venv_dir, ignore_errors=True)
    finally:
        server.stop()
    recorded = stats_of(ours, "recorded_s")
    result.runs = len(ours)
    result.metric("quiesce_recorded_s", recorded, "s")
    result.metric("quiesce_bare_http_s", stats_of(ours, "bare_async_s"), "s")
    result.metric("peak_rss_mb", stats_of(ours, "peak_rss_mb"), "MB")
    result.value = f"{recorded.fmt(1e3, 3, 'ms')} per recorded call"
    rows = [{"per call": "quiesce recorded call (Caller: append, POST, validate, append)",
             "median [min–max]": recorded.fmt(1e3, 3, "ms")},
            {"per call": "quiesce side: bare HTTP POST (the same HTTP client, nothing recorded)",
             "median [min–max]": stats_of(ours, "bare_async_s").fmt(1e3, 3, "ms")}]  # fmt: skip
    if python is None:
        result.status = "unavailable"
        result.reason = f"DBOS baseline unavailable: {reason}; quiesce: {result.value}"
        result.rows = rows
        return result
    noop, remote = stats_of(theirs, "dbos_noop_s"), stats_of(theirs, "dbos_remote_s")
    ratios = [d["dbos_noop_s"] / q["recorded_s"] for q, d in zip(ours, theirs, strict=True)]
    like = [d["dbos_remote_s"] / q["recorded_s"] for q, d in zip(ours, theirs, strict=True)]
    ratio, like_ratio = statistics.median(ratios), statistics.median(like)
    result.metric("dbos_noop_workflow_s", noop, "s")
    result.metric("dbos_http_workflow_s", remote, "s")
    result.metric("dbos_bare_http_s", stats_of(theirs, "bare_sync_s"), "s")
    result.metric("dbos_peak_rss_mb", stats_of(theirs, "peak_rss_mb"), "MB")
    result.metric("ratio_noop", Stats.of(ratios), "x")
    result.metric("ratio_like_for_like", Stats.of(like), "x")
    result.value += f"; DBOS no-op-step workflow / quiesce = {Stats.of(ratios).fmt(1, 2)}x"
    result.baseline = (
        f"DBOS {theirs[0].get('dbos_version')}: {noop.fmt(1e3, 3, 'ms')} per workflow with a no-op step;"
        f" {remote.fmt(1e3, 3, 'ms')} with the same HTTP call in its step ({like_ratio:.2f}x)"
    )
    result.met = ratio >= 3.0
    rows += [
        {"per call": "DBOS workflow, one durable no-op step", "median [min–max]": noop.fmt(1e3, 3, "ms")},
        {"per call": "DBOS workflow, one step making the same HTTP POST",
         "median [min–max]": remote.fmt(1e3, 3, "ms")},
        {"per call": "DBOS side: bare HTTP POST (httpx sync)",
         "median [min–max]": stats_of(theirs, "bare_sync_s").fmt(1e3, 3, "ms")},
    ]  # fmt: skip
    result.rows = rows
    result.notes.append(
        f"{n} calls per run after a 10% warm-up; the DBOS system database is SQLite in"
        f" {theirs[0].get('journal_mode')} mode with SQLite's default synchronous=FULL; DBOS peak RSS"
        f" {stats_of(theirs, 'peak_rss_mb').fmt(1, 0, 'MB')}"
    )
    return result
