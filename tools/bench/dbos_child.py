"""Measure #2's DBOS side, run by the DBOS venv's Python (stdlib, ``dbos``, ``anyio``, ``httptools``).

    VENV/bin/python -c "import runpy; runpy.run_path('dbos_child.py', run_name='__main__')" JSON

JSON: ``{"db": PATH, "url": URL, "n": N, "synchronous": "FULL"|"OFF", "http_module": PATH}``.
Creates the SQLite system database in WAL mode and sets ``PRAGMA synchronous`` on every
connection DBOS opens (SQLAlchemy ``connect`` event): ``FULL`` (SQLite's default: the WAL is
fsynced at every commit) or ``OFF`` (never fsynced). ``db`` may instead be a
``postgresql://`` URL (an empty database; ``synchronous: "ON"``: the server's default
``synchronous_commit``, the WAL flushed at every commit) — DBOS's recommended production database.
It then interleaves, ``n`` times after a 10%
warm-up and in a rotating order, six workflows: one durable no-op step (transport: none), one
step that makes the loopback HTTP POST that quiesce's recorded call makes — with quiesce's own
HTTP client (``coordinator/http.py``, loaded by path from ``http_module`` so both sides use the
same transport code) — and ten such steps in one workflow (DBOS's fixed cost per workflow shared
ten ways), each with DBOS's async API and with its sync API (run on one worker
thread; the step drives the same client on that thread's event loop). The faster of the two
APIs is what measure #2 compares (``*_best_s``). Every commit DBOS makes is counted
(SQLAlchemy ``commit`` event), so the fsyncs per workflow are known. Prints one JSON line with the
median seconds of each, commits per workflow, and the peak RSS. Imports nothing else of quiesce.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import sqlite3
import statistics
import sys
import time
from typing import Any

BODY = {"schema_version": 1, "checkpoint_id": "e1-000002", "deadline_ts": 4102444800.0}
HEADERS = {
    "Authorization": "Bearer bench-token",
    "Accept": "application/json",
    "Content-Type": "application/json",
}


def _peak_rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _load_http(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("quiesce_http", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["quiesce_http"] = module
    spec.loader.exec_module(module)
    return module


async def run(args: dict[str, Any]) -> dict[str, Any]:
    from dbos import DBOS  # type: ignore[import-not-found,unused-ignore]
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    db, url, n, sync = str(args["db"]), str(args["url"]), int(args["n"]), str(args["synchronous"])
    postgres = db.startswith("postgresql")
    if sync not in (("ON",) if postgres else ("FULL", "OFF")):
        raise SystemExit(f"synchronous must be FULL or OFF (SQLite) or ON (PostgreSQL), not {sync}")
    commits = [0]

    if not postgres:

        @event.listens_for(Engine, "connect")
        def _pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute(f"PRAGMA synchronous={sync}")
            cursor.close()

    @event.listens_for(Engine, "commit")
    def _count(_conn: Any) -> None:
        commits[0] += 1

    if not postgres:
        with sqlite3.connect(db) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
    http_module = _load_http(str(args["http_module"]))
    http = http_module.HttpClient()
    payload = json.dumps(BODY).encode()

    async def post() -> Any:
        reply = await http.request("POST", url, headers=HEADERS, body=payload, timeout_s=30, max_body=1 << 20)
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}")
        return json.loads(reply.body)

    system_database = db if postgres else f"sqlite:///{db}"
    DBOS(config={"name": "quiesce-bench", "system_database_url": system_database, "log_level": "WARNING"})

    # the async API (workflows on this event loop) ...
    async def _noop_step(i: int) -> int:
        return i

    noop_step: Any = DBOS.step()(_noop_step)

    async def _http_step(i: int) -> Any:
        return await post()

    http_step: Any = DBOS.step()(_http_step)

    async def _noop_flow(i: int) -> int:
        result: int = await noop_step(i)
        return result

    noop_flow: Any = DBOS.workflow()(_noop_flow)

    async def _http_flow(i: int) -> Any:
        return await http_step(i)

    http_flow: Any = DBOS.workflow()(_http_flow)

    async def _http10_flow(i: int) -> Any:  # ten steps: the workflow's fixed cost shared ten ways
        for k in range(10):
            await http_step(i * 10 + k)

    http10_flow: Any = DBOS.workflow()(_http10_flow)

    # ... and the sync API (workflows on a worker thread; its step runs the same client on a
    # private event loop of that thread)
    private: dict[int, asyncio.AbstractEventLoop] = {}

    def post_sync() -> Any:
        import threading

        loop = private.setdefault(threading.get_ident(), asyncio.new_event_loop())
        return loop.run_until_complete(post_on(loop))

    clients: dict[int, Any] = {}

    async def post_on(loop: asyncio.AbstractEventLoop) -> Any:
        client = clients.setdefault(id(loop), http_module.HttpClient())
        reply = await client.request(
            "POST", url, headers=HEADERS, body=payload, timeout_s=30, max_body=1 << 20
        )
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}")
        return json.loads(reply.body)

    def _noop_step_sync(i: int) -> int:
        return i

    noop_step_sync: Any = DBOS.step()(_noop_step_sync)

    def _http_step_sync(i: int) -> Any:
        return post_sync()

    http_step_sync: Any = DBOS.step()(_http_step_sync)

    def _noop_flow_sync(i: int) -> int:
        result: int = noop_step_sync(i)
        return result

    noop_flow_sync: Any = DBOS.workflow()(_noop_flow_sync)

    def _http_flow_sync(i: int) -> Any:
        return http_step_sync(i)

    http_flow_sync: Any = DBOS.workflow()(_http_flow_sync)

    def _http10_flow_sync(i: int) -> Any:
        for k in range(10):
            http_step_sync(i * 10 + k)

    http10_flow_sync: Any = DBOS.workflow()(_http10_flow_sync)

    DBOS.launch()
    worker = concurrent.futures.ThreadPoolExecutor(1)
    loop = asyncio.get_running_loop()
    try:
        mode = "PostgreSQL WAL"
        if not postgres:
            with sqlite3.connect(db) as conn:
                mode = conn.execute("PRAGMA journal_mode").fetchone()[0]

        async def in_worker(flow: Any, i: int) -> None:
            await loop.run_in_executor(worker, flow, i)

        sides: dict[str, Any] = {
            "noop": lambda i: noop_flow(i),
            "http": lambda i: http_flow(i),
            "noop_sync": lambda i: in_worker(noop_flow_sync, i),
            "http_sync": lambda i: in_worker(http_flow_sync, i),
            "http10": lambda i: http10_flow(i),
            "http10_sync": lambda i: in_worker(http10_flow_sync, i),
        }
        took: dict[str, list[float]] = {side: [] for side in sides}
        per_flow: dict[str, list[int]] = {side: [] for side in sides}
        names = list(sides)
        warm = max(1, n // 10)
        for i in range(n + warm):
            shift = i % len(names)
            for side in names[shift:] + names[:shift]:
                before = commits[0]
                start = time.perf_counter()
                await sides[side](i)
                elapsed = time.perf_counter() - start
                if i >= warm:
                    took[side].append(elapsed)
                    per_flow[side].append(commits[0] - before)
    finally:
        DBOS.destroy()
        await http.aclose()
        worker.shutdown()
    from importlib.metadata import version

    out: dict[str, Any] = {}
    for side in took:
        out[f"dbos_{side}_s"] = statistics.median(took[side])
        out[f"commits_{side}"] = statistics.median(per_flow[side])
    # the faster of DBOS's two APIs is the one compared
    for side in ("noop", "http", "http10"):
        out[f"dbos_{side}_best_s"] = min(out[f"dbos_{side}_s"], out[f"dbos_{side}_sync_s"])
    return {
        **out,
        "journal_mode": mode,
        "synchronous": sync,
        "dbos_version": version("dbos"),
    }


if __name__ == "__main__":
    out = asyncio.run(run(json.loads(sys.argv[1])))
    out["peak_rss_mb"] = _peak_rss_mb()
    sys.stdout.write(json.dumps(out) + "\n")
