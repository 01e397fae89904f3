"""The crash matrices of `test_crashmatrix.py`, run as child processes beside the suite.

Rule: when a session selects a crash-matrix test, every matrix is started once, as early as the
session allows, and runs while the rest of the suite does: each mostly waits on its reference
servers' latency and its ledger's fsyncs, so the suite takes little longer than without them.
- Run serially, the session's first test starts them (`tests/conftest.py`, `crash_matrices`), the
  PostgreSQL ones in a database of the session's cluster.
- Run with pytest-xdist, the controller starts them once, when the first worker has collected
  (`tests/conftest.py`, `pytest_xdist_node_collection_finished`), the PostgreSQL ones on a cluster
  of its own; every worker is told the folder (`workerinput`), so a crash-matrix test judges its
  matrix on whichever worker it runs.

Each matrix is one `python -m quiesce.tools.crashmatrix` child in a process group of its own,
under a shell that writes its exit code to `<name>.code` when it ends (the whole output goes to
`<name>.log`); `started.json` lists the matrices started, written once they all are. A
crash-matrix test waits for its own code file (`Matrices.finish`), so it needs no handle on the
process. Whoever started them kills any still running at the session's end (`Matrices.kill`).

The matrices:
- `sqlite`: v1, every point of every cycle; `postgres`: v1, every third point, in a database of
  the session's cluster;
- `v2-sqlite`: Gym's unified plane, every cycle (save, stop, restore, restore --resume), every
  `V2_SAMPLE`-th of the points that matter (`crashmatrix_v2.MatrixV2.plan_v2`: from the append
  before `attempt.started` on, and every send point); `v2-postgres`: every `V2_PG_SAMPLE`-th.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from quiesce.tools.gymsim.cluster import IMPORT_ROOT
from quiesce.tools.pgtemp import TempPostgres

__all__ = ["MODULE", "V2_PG_SAMPLE", "V2_SAMPLE", "WORKER_KEY", "Matrices", "start_matrices"]

#: the test module whose selection starts the matrices
MODULE = "test_crashmatrix.py"
#: the key of `workerinput` (pytest-xdist) that names the controller's matrix folder
WORKER_KEY = "quiesce_crash_matrices"
#: v2's points run in CI: every 4th on SQLite (36 of 142), every 18th on PostgreSQL (8) — every
#: cycle's points spread over the whole attempt; the four matrices run beside the suite on two
#: cores, and the suite must stay well under CI's 30 minutes (`--sample 1` runs them all)
V2_SAMPLE = 4
V2_PG_SAMPLE = 18
_STARTED = "started.json"
#: writes the child's exit code once it has ended (renamed in, so a reader never sees half of it)
_SHELL = 'log=$1 code=$2; shift 2; "$@" >"$log" 2>&1; echo $? >"$code.part"; mv "$code.part" "$code"'


@dataclass
class Matrices:
    """The matrices of one session, in `folder`: started here (`pgids` set) or by another process."""

    folder: Path
    pgids: list[int] = field(default_factory=list)

    def started(self) -> list[str]:
        """The names of the matrices started; waits until the starter has listed them."""
        listing = self.folder / _STARTED
        while not listing.exists():
            time.sleep(0.5)
        names: list[str] = json.loads(listing.read_text(encoding="utf-8"))
        return names

    def finish(self, name: str) -> tuple[int, str]:
        """Wait for matrix `name` to end; its exit code and its whole output (the tail is printed)."""
        started = self.started()
        if name not in started:
            raise LookupError(f"crash matrix {name!r} was not started (started: {started})")
        code_file = self.folder / f"{name}.code"
        while not code_file.exists():
            time.sleep(1.0)
        output = (self.folder / f"{name}.log").read_text(encoding="utf-8", errors="replace")
        print(output[-6000:])
        return int(code_file.read_text(encoding="utf-8").strip()), output

    def kill(self) -> None:
        """Kill every matrix this process started that is still running (and its servers)."""
        for pgid in self.pgids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        self.pgids.clear()


def _start(matrices: Matrices, name: str, *args: str) -> None:
    folder = matrices.folder
    process = subprocess.Popen(
        ["/bin/sh", "-c", _SHELL, "sh", str(folder / f"{name}.log"), str(folder / f"{name}.code"),
         sys.executable, "-m", "quiesce.tools.crashmatrix", *args],
        cwd=str(IMPORT_ROOT),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    matrices.pgids.append(process.pid)  # the leader of its new session and process group


def start_matrices(folder: Path, postgres: TempPostgres | None) -> Matrices:
    """Start the SQLite matrices (v1, v2), and the PostgreSQL ones when a cluster is given."""
    matrices = Matrices(folder)
    _start(matrices, "sqlite", "--ledger", "sqlite", "--cycle", "all")
    v2 = ("--plane", "v2", "--cycle", "all")
    _start(matrices, "v2-sqlite", *v2, "--ledger", "sqlite", "--sample", str(V2_SAMPLE))
    names = ["sqlite", "v2-sqlite"]
    if postgres is not None:

        def on_postgres(sample: int) -> tuple[str, ...]:
            url = postgres.create_database(f"t_{uuid.uuid4().hex[:20]}")
            return ("--ledger", "postgres", "--ledger-url", url, "--sample", str(sample))

        _start(matrices, "postgres", "--cycle", "all", *on_postgres(3))
        _start(matrices, "v2-postgres", *v2, *on_postgres(V2_PG_SAMPLE))
        names += ["postgres", "v2-postgres"]
    listing = folder / _STARTED
    listing.with_suffix(".part").write_text(json.dumps(names), encoding="utf-8")
    listing.with_suffix(".part").rename(listing)
    return matrices
