"""The crash matrix as a test: every crash point of every cycle (save, restore, restore --resume,
restore → checkpoint) on SQLite, a sampled third on PostgreSQL; on Gym's unified plane (v2) every
cycle (save, stop, restore, restore --resume), every second of the points that matter on SQLite and
every ninth on PostgreSQL (`tests/recovery/matrices.py`).

Slow (minutes) but run by default: CI runs the full SQLite matrix. The matrices are child
processes started once per session, and run beside the rest of the suite
(`tests/recovery/matrices.py`); each test waits for its own and judges it. Every matrix's table
is printed; run with `-s` to see it (or run `python -m quiesce.tools.crashmatrix` directly).
"""

from __future__ import annotations

import pytest

from quiesce.tools.pgtemp import TempPostgres
from tests.recovery.matrices import Matrices

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]
CYCLES = ["save", "restore", "restore-resume", "restore-checkpoint"]
CYCLES_V2 = ["v2-save", "v2-stop", "v2-restore", "v2-restore-resume"]


def _judge(matrices: Matrices | None, name: str, cycles: list[str] = CYCLES) -> None:
    assert matrices is not None, "the session started no crash matrix although this test was selected"
    code, output = matrices.finish(name)
    assert code == 0, output[-6000:]
    assert "all invariants hold" in output
    summary = [line for line in output.splitlines() if " points (" in line]
    assert [line.split(":")[0] for line in summary] == cycles
    assert all(", 0 failed;" in line for line in summary)
    rows = [line for line in output.splitlines() if line.split(" ")[0] in cycles and " points" not in line]
    assert rows, "the matrix ran no point"
    assert all(line.endswith("  ok") for line in rows)


def test_full_crash_matrix_on_sqlite(crash_matrices: Matrices | None) -> None:
    _judge(crash_matrices, "sqlite")


@pytest.mark.postgres
def test_sampled_crash_matrix_on_postgres(postgres: TempPostgres, crash_matrices: Matrices | None) -> None:
    _judge(crash_matrices, "postgres")


def test_v2_crash_matrix_on_sqlite(crash_matrices: Matrices | None) -> None:
    _judge(crash_matrices, "v2-sqlite", CYCLES_V2)


@pytest.mark.postgres
def test_sampled_v2_crash_matrix_on_postgres(postgres: TempPostgres, crash_matrices: Matrices | None) -> None:
    _judge(crash_matrices, "v2-postgres", CYCLES_V2)
