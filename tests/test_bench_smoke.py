"""`python -m quiesce.tools.bench --quick` runs every measure end to end and writes the documented JSON shape.

A smoke check of the bench harness only: tiny sizes, one run per measure. Nothing here asserts a
time — the figures of a quick run mean nothing (speed is measured, never asserted).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from quiesce.tools.bench.__main__ import MEASURES, output_stem

REPO = Path(__file__).resolve().parents[1]
MEASURE_KEYS = {"id", "title", "goal", "status", "met", "value", "baseline", "reason", "runs", "metrics",
                "rows", "notes", "settings", "load", "raw"}  # fmt: skip
LOAD_KEYS = {"runs", "cores", "load1_max", "cpu_pressure", "foreign_cores", "own_cores", "loaded"}


def test_quick_bench_runs_every_measure_and_writes_json_and_markdown(tmp_path: Path) -> None:
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "quiesce.tools.bench", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (out / "latest.json").exists(), "--quick must never write latest.*"
    assert not (out / "latest.md").exists()
    document = json.loads((out / "quick.json").read_text(encoding="utf-8"))
    assert document["quick"] is True
    assert document["commit"]
    assert {"cpu", "cores", "ram_gb", "disk", "python", "sqlite"} <= set(document["machine"])
    measures = {m["id"]: m for m in document["measures"]}
    assert sorted(measures) == sorted(MEASURES) == list(range(1, 15))
    for measure in measures.values():
        assert set(measure) == MEASURE_KEYS, measure["id"]
        assert measure["status"] in ("ok", "unavailable"), (measure["id"], measure["reason"])
        if measure["status"] == "ok":
            assert measure["met"] in (True, False, None)
            assert measure["runs"] >= 1
            assert measure["settings"], f"measure {measure['id']} names no side's settings"
            for side in measure["settings"]:
                assert "side" in side
                assert "durability" in side
            for name, figure in measure["metrics"].items():
                assert {"median", "min", "max", "n", "unit"} <= set(figure), name
                assert figure["min"] <= figure["median"] <= figure["max"], name
            # what else the machine did, recorded for every measure; loaded means not judged
            assert set(measure["load"]) == LOAD_KEYS, measure["id"]
            assert measure["load"]["foreign_cores"] >= 0
            if measure["load"]["loaded"]:
                assert measure["met"] is None
                assert "NOT JUDGED" in measure["notes"][0]
            assert all("load" in run and "target" in run for run in measure["raw"]), measure["id"]
    # DBOS is skipped with --quick unless a venv is given; the quiesce side still ran
    assert measures[2]["status"] == "unavailable"
    assert {"quiesce_caller_sync_http_s", "quiesce_caller_sync_http10_s", "quiesce_fsync_http_s"} <= set(
        measures[2]["metrics"]
    )
    # the new measures ran and report what they must
    assert {"reuse_ratio_8", "fresh_ratio_8", "discover_s_8"} <= set(measures[4]["metrics"])
    assert {"replay_events_per_s", "replay_mb_per_s", "replay_cpu_s", "peak_rss_mb"} <= set(
        measures[5]["metrics"]
    )
    assert {"beyond_resume_round_s", "fresh_beyond_resume_round_s"} <= set(measures[6]["metrics"])
    assert {"added_s", "added_cpu_s", "overhead"} <= set(measures[3]["metrics"])
    assert {"v2_added_s", "v2_added_cpu_s", "v2_overhead"} <= set(measures[3]["metrics"])  # both planes
    assert [row["plane"] for row in measures[3]["rows"]] == ["v1", "v2"]
    # #3 is judged on the difference of medians, with the pooled bootstrap interval and raw samples
    assert {"added_pooled_s", "v2_added_pooled_s", "paired_s"} <= set(measures[3]["metrics"])
    assert len(measures[3]["raw"]) == 2  # one run per plane
    for run in measures[3]["raw"]:
        real, null = run["samples"]["real"]["wall_s"], run["samples"]["null"]["wall_s"]
        assert len(real) == len(null) == 2  # --quick: two cycles per side
        assert run["added_s"] == pytest.approx(statistics.median(real) - statistics.median(null))
    # v2 save by quiesce vs Gym's own coordination: both modes, and the same control calls on both sides
    assert {"reuse_ratio_8", "fresh_ratio_8", "reuse_gym_s_8", "fresh_quiesce_s_8"} <= set(
        measures[11]["metrics"]
    )
    assert measures[11]["metrics"]["same_calls"]["min"] == 1.0, measures[11]["notes"]
    if measures[7]["status"] == "ok":  # PostgreSQL binaries are on the machine
        assert {"ratio", "renew_s", "overhead"} <= set(measures[7]["metrics"])
    assert {"ratio", "fresh_wall_s", "history_wall_s", "history_cold_wall_s"} <= set(measures[8]["metrics"])
    # the cold passes started cold (mincore found the ledger's pages gone)
    for number in (5, 6, 8):
        assert measures[number]["metrics"]["cold_resident_before"]["max"] <= 0.02, number
    # cost growth: every command and the save at both sizes; the ratios the goals judge
    assert {"mixed_history_limit_20_ratio", "mixed_status_ratio", "mixed_save_ratio"} <= set(
        measures[12]["metrics"]
    )
    assert [row["events before"] for row in measures[12]["rows"]] == ["0", "2,000"]
    assert all(row["attempts"] for row in measures[12]["rows"])
    assert {"real_s", "process_s", "null_s"} <= set(measures[9]["metrics"])
    markdown = (out / "quick.md").read_text(encoding="utf-8")
    assert "| # | measure |" in markdown
    assert "Settings of each side:" in markdown
    assert document["commit"] in markdown
    assert "## Machine" in markdown
    assert not list(out.glob("quiesce-bench-*")), "the work folder is removed"


def test_quick_bench_measures_one_rollouts_lineage_and_the_fold(tmp_path: Path) -> None:
    """Measure #13 (issue #38) at tiny sizes: `quiesce rollouts --rollout ID` from a cold process and
    the lineage fold against replay, on a history whose lineage rotates through many rollout ids."""
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "quiesce.tools.bench", "--quick", "--only", "13", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (measure,) = json.loads((out / "quick.json").read_text(encoding="utf-8"))["measures"]
    assert measure["id"] == 13
    assert measure["status"] == "ok", measure["reason"]
    assert set(measure) == MEASURE_KEYS
    assert {"rollout_beyond_start_s", "process_start_s", "fold_events_per_s", "replay_events_per_s",
            "fold_replay_ratio", "peak_rss_mb"} <= set(measure["metrics"])  # fmt: skip
    assert measure["met"] in (True, False, None)
    assert "500 rollouts" in measure["title"]
    sides = [side["side"] for side in measure["settings"]]
    assert sides == ["rollouts --rollout ID", "lineage fold", "replay"]


def test_only_and_quick_runs_never_write_latest() -> None:
    assert output_stem(quick=False, only=None) == "latest"
    assert output_stem(quick=True, only=None) == "quick"
    assert output_stem(quick=True, only="3") == "quick"
    assert output_stem(quick=False, only="5,3") == "only-3,5"
