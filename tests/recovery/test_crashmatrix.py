"""The crash matrix as a test: every crash point of every cycle (save, restore, restore --resume,
restore → checkpoint) on SQLite, a sampled third on PostgreSQL.

Slow (minutes) but run by default: CI runs the full SQLite matrix. The matrix prints its table;
run with `-s` to see it (or run `python -m tools.crashmatrix` directly).
"""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from tools.gymsim.cluster import REPO_ROOT
from tools.pgtemp import TempPostgres

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]
CYCLES = ["save", "restore", "restore-resume", "restore-checkpoint"]


def _matrix(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "tools.crashmatrix", *args],
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        check=False,
    )
    print(done.stdout[-6000:])
    return done


def _summary(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if " points (" in line]


def test_full_crash_matrix_on_sqlite() -> None:
    done = _matrix("--ledger", "sqlite", "--cycle", "all")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "all invariants hold" in done.stdout
    summary = _summary(done.stdout)
    assert [line.split(":")[0] for line in summary] == CYCLES
    assert all(", 0 failed;" in line for line in summary)


@pytest.mark.postgres
def test_sampled_crash_matrix_on_postgres(postgres: TempPostgres) -> None:
    url = postgres.create_database(f"t_{uuid.uuid4().hex[:20]}")
    done = _matrix("--ledger", "postgres", "--ledger-url", url, "--cycle", "all", "--sample", "3")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "all invariants hold" in done.stdout
    summary = _summary(done.stdout)
    assert [line.split(":")[0] for line in summary] == CYCLES
    assert all(", 0 failed;" in line for line in summary)
