"""Measure #2's DBOS side, run by the throwaway venv's Python (stdlib, ``dbos`` and ``httpx`` only).

    VENV/bin/python -c "import runpy; runpy.run_path('dbos_child.py', run_name='__main__')" JSON

JSON: ``{"db": PATH, "url": URL, "n": N}``. Creates the SQLite system database in WAL mode
(``synchronous`` stays SQLite's default, FULL), launches DBOS on it, and interleaves, ``n`` times
after a 10% warm-up: a workflow with one durable no-op step; a workflow whose one step makes the
same loopback HTTP POST that quiesce's recorded call makes; and that bare HTTP POST. Prints one
JSON line with the median seconds of each and the peak RSS. Imports nothing of quiesce.
"""

from __future__ import annotations

import json
import sqlite3
import statistics
import sys
import time
from typing import Any

BODY = {"schema_version": 1, "checkpoint_id": "e1-000002", "deadline_ts": 4102444800.0}


def _peak_rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(args: dict[str, Any]) -> dict[str, Any]:
    import httpx
    from dbos import DBOS  # type: ignore[import-not-found,unused-ignore]

    db, url, n = str(args["db"]), str(args["url"]), int(args["n"])
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
    DBOS(config={"name": "quiesce-bench", "system_database_url": f"sqlite:///{db}", "log_level": "WARNING"})
    http = httpx.Client(trust_env=False)
    headers = {"Authorization": "Bearer bench-token", "Accept": "application/json"}

    def bare() -> Any:
        reply = http.post(url, json=BODY, headers=headers)
        reply.raise_for_status()
        return reply.json()

    def noop_step(i: int) -> int:
        return i

    def http_step(i: int) -> Any:
        return bare()

    noop = DBOS.step()(noop_step)
    remote = DBOS.step()(http_step)

    def noop_flow(i: int) -> int:
        result: int = noop(i)
        return result

    def remote_flow(i: int) -> Any:
        return remote(i)

    run_noop = DBOS.workflow()(noop_flow)
    run_remote = DBOS.workflow()(remote_flow)
    DBOS.launch()
    try:
        with sqlite3.connect(db) as conn:
            mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        noops: list[float] = []
        remotes: list[float] = []
        bares: list[float] = []
        warm = max(1, n // 10)
        for i in range(n + warm):
            start = time.perf_counter()
            run_noop(i)
            noop_s = time.perf_counter() - start
            start = time.perf_counter()
            run_remote(i)
            remote_s = time.perf_counter() - start
            start = time.perf_counter()
            bare()
            bare_s = time.perf_counter() - start
            if i >= warm:
                noops.append(noop_s)
                remotes.append(remote_s)
                bares.append(bare_s)
    finally:
        DBOS.destroy()
        http.close()
    import dbos

    return {
        "dbos_noop_s": statistics.median(noops),
        "dbos_remote_s": statistics.median(remotes),
        "bare_sync_s": statistics.median(bares),
        "journal_mode": mode,
        "dbos_version": getattr(dbos, "__version__", None) or _version("dbos"),
    }


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    out = main(json.loads(sys.argv[1]))
    out["peak_rss_mb"] = _peak_rss_mb()
    sys.stdout.write(json.dumps(out) + "\n")
