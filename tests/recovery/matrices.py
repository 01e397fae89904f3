"""The crash matrices of `test_crashmatrix.py`, run as child processes beside the suite.

Rule: when a session selects a crash-matrix test, every matrix is started at the session's first
test (`tests/conftest.py`, `crash_matrices`) and runs while the rest of the suite does: each mostly
waits on its reference servers' latency and its ledger's fsyncs, so the suite takes little longer
than without them. Each crash-matrix test then waits for its own child and judges its output; any
child still running at the session's end is killed. The matrices:
- `sqlite`: v1, every point of every cycle; `postgres`: v1, every third point, in a database of
  the session's cluster;
- `v2-sqlite`: Gym's unified plane, every cycle (save, stop, restore, restore --resume), every
  `V2_SAMPLE`-th of the points that matter (`crashmatrix_v2.MatrixV2.plan_v2`: from the append
  before `attempt.started` on, and every send point); `v2-postgres`: every `V2_PG_SAMPLE`-th.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from quiesce.tools.gymsim.cluster import IMPORT_ROOT
from quiesce.tools.pgtemp import TempPostgres

__all__ = ["MODULE", "V2_PG_SAMPLE", "V2_SAMPLE", "Running", "start_matrices"]

#: the test module whose selection starts the matrices
MODULE = "test_crashmatrix.py"
#: v2's points run in CI: every 4th on SQLite (36 of 142), every 18th on PostgreSQL (8) — every
#: cycle's points spread over the whole attempt; the four matrices run beside the suite on two
#: cores, and the suite must stay well under CI's 30 minutes (`--sample 1` runs them all)
V2_SAMPLE = 4
V2_PG_SAMPLE = 18


@dataclass
class Running:
    """One `python -m quiesce.tools.crashmatrix` child; its stdout and stderr go to `log`."""

    process: subprocess.Popen[bytes]
    log: Path

    def finish(self) -> tuple[int, str]:
        """Wait for the child; its exit code and its whole output (the tail is printed)."""
        code = self.process.wait()
        output = self.log.read_text(encoding="utf-8", errors="replace")
        print(output[-6000:])
        return code, output

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _start(log: Path, *args: str) -> Running:
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "quiesce.tools.crashmatrix", *args],
            cwd=str(IMPORT_ROOT),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Running(process, log)


def start_matrices(folder: Path, postgres: TempPostgres | None) -> dict[str, Running]:
    """Start the SQLite matrices (v1, v2), and the PostgreSQL ones when a cluster is given."""
    running = {"sqlite": _start(folder / "sqlite.log", "--ledger", "sqlite", "--cycle", "all")}
    v2 = ("--plane", "v2", "--cycle", "all")
    running["v2-sqlite"] = _start(
        folder / "v2-sqlite.log", *v2, "--ledger", "sqlite", "--sample", str(V2_SAMPLE)
    )
    if postgres is not None:
        url = postgres.create_database(f"t_{uuid.uuid4().hex[:20]}")
        args = ("--ledger", "postgres", "--ledger-url", url, "--cycle", "all", "--sample", "3")
        running["postgres"] = _start(folder / "postgres.log", *args)
        url = postgres.create_database(f"t_{uuid.uuid4().hex[:20]}")
        v2_pg = ("--ledger", "postgres", "--ledger-url", url, "--sample", str(V2_PG_SAMPLE))
        running["v2-postgres"] = _start(folder / "v2-postgres.log", *v2, *v2_pg)
    return running
