"""The two crash matrices of `test_crashmatrix.py`, run as child processes beside the suite.

Rule: when a session selects a crash-matrix test, both matrices (SQLite: every point of every
cycle; PostgreSQL: every third point, in a database of the session's cluster) are started at the
session's first test (`tests/conftest.py`, `crash_matrices`) and run while the rest of the suite
does: each mostly waits on its reference servers' latency and its ledger's fsyncs, so the suite
takes little longer than without them. Each crash-matrix test then waits for its own child and
judges its output; any child still running at the session's end is killed.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from quiesce.tools.gymsim.cluster import IMPORT_ROOT
from quiesce.tools.pgtemp import TempPostgres

__all__ = ["MODULE", "Running", "start_matrices"]

#: the test module whose selection starts the matrices
MODULE = "test_crashmatrix.py"


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
    """Start the SQLite matrix, and the PostgreSQL one when a cluster is given."""
    running = {"sqlite": _start(folder / "sqlite.log", "--ledger", "sqlite", "--cycle", "all")}
    if postgres is not None:
        url = postgres.create_database(f"t_{uuid.uuid4().hex[:20]}")
        args = ("--ledger", "postgres", "--ledger-url", url, "--cycle", "all", "--sample", "3")
        running["postgres"] = _start(folder / "postgres.log", *args)
    return running
