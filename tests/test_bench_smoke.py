"""`python -m tools.bench --quick` runs end to end and writes the documented JSON shape.

A smoke check of the bench harness only: tiny sizes, one run per measure. Nothing here asserts a
time — the figures of a quick run mean nothing (DESIGN.md: speed is measured, never asserted).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MEASURE_KEYS = {"id", "title", "goal", "status", "met", "value", "baseline", "reason", "runs", "metrics",
                "rows", "notes"}  # fmt: skip


def test_quick_bench_writes_json_and_markdown(tmp_path: Path) -> None:
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "tools.bench", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads((out / "latest.json").read_text(encoding="utf-8"))
    assert document["quick"] is True
    assert {"cpu", "cores", "ram_gb", "disk", "python", "sqlite"} <= set(document["machine"])
    measures = {m["id"]: m for m in document["measures"]}
    assert sorted(measures) == [1, 2, 3, 4, 5, 6, 7]
    for measure in measures.values():
        assert set(measure) == MEASURE_KEYS, measure["id"]
        assert measure["status"] in ("ok", "unavailable"), (measure["id"], measure["reason"])
        if measure["status"] == "ok":
            assert measure["met"] in (True, False, None)
            assert measure["runs"] >= 1
            for name, figure in measure["metrics"].items():
                assert {"median", "min", "max", "n", "unit"} <= set(figure), name
                assert figure["min"] <= figure["median"] <= figure["max"], name
    # DBOS is skipped with --quick unless a venv is given; the quiesce side still ran
    assert measures[2]["status"] == "unavailable"
    assert "quiesce_recorded_s" in measures[2]["metrics"]
    markdown = (out / "latest.md").read_text(encoding="utf-8")
    assert "| # | measure |" in markdown
    assert "## Machine" in markdown
    assert not list(out.glob("quiesce-bench-*")), "the work folder is removed"
