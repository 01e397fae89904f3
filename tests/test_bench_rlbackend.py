"""Measure #14 (issue #39) at tiny sizes: a snapshot through quiesce's NeMo RL backend against the
embedded coordinator's save on the same two Gym deployments, run end to end by the bench.

A smoke check only: nothing here asserts a time (speed is measured, never asserted). It checks
that both sides saved the same episodes into fresh folders of the caller's, that the backend's
folder differs by RL's `gym_checkpoint.json` alone, that both ledgers recorded the same events
per save, and that the judged figure is the difference of the two sides' medians.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from quiesce.tools.bench.__main__ import MEASURES
from quiesce.tools.bench.rlbackend import DEPLOYMENTS, EPISODES, deployment_spec

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)


def test_deployments_repeat_instance_names_under_rl_replica_names() -> None:
    specs = [deployment_spec(i) for i in range(DEPLOYMENTS)]
    names = [[s["name"] for s in spec["servers"]] for spec in specs]
    instances = [[s["instance"] for s in spec["servers"]] for spec in specs]
    assert instances[0] == instances[1]  # replicas of one Gym config
    assert not set(names[0]) & set(names[1])
    assert all(name.startswith("nemo_gym.r1.") for name in names[1])
    env = next(s for s in specs[1]["servers"] if s["kind"] == "environment")
    assert env["agent"] == "nemo_gym.r1.agent"  # references stay inside the deployment


def test_quick_bench_measures_the_rl_backend_against_the_embedded_coordinator(tmp_path: Path) -> None:
    assert MEASURES[14][0] == "rlbackend"
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "quiesce.tools.bench", "--quick", "--only", "14", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (measure,) = json.loads((out / "quick.json").read_text(encoding="utf-8"))["measures"]
    assert measure["id"] == 14
    assert measure["status"] == "ok", measure["reason"]
    assert measure["met"] in (True, False, None)
    figures = {"backend_s", "embedded_s", "extra_s", "extra_pooled_s", "ratio", "backend_cpu_s",
               "embedded_cpu_s", "extra_cpu_s", "paired_s", "manifest_bytes", "actors_s",
               "actors_extra_s", "actors_extra_pooled_s", "actors_ratio"}  # fmt: skip
    assert figures <= set(measure["metrics"])
    assert [row["side"] for row in measure["rows"]] == [
        "embedded",
        "backend",
        "actors",
        "backend - embedded",
        "actors - embedded (reported, not judged)",
    ]
    assert [s["side"].split(" ")[0] for s in measure["settings"]] == ["backend", "actors", "embedded"]
    for side in measure["settings"]:
        assert side["durability"].startswith("full")
    (run,) = measure["raw"]
    backend, embedded = run["samples"]["backend"]["wall_s"], run["samples"]["embedded"]["wall_s"]
    assert len(backend) == len(embedded) == 3  # --quick: three rounds
    assert run["extra_s"] == pytest.approx(statistics.median(backend) - statistics.median(embedded))
    assert run["ratio"] == pytest.approx(statistics.median(backend) / statistics.median(embedded))
    assert run["episodes"] == DEPLOYMENTS * EPISODES
    # the backend's folder holds the embedded one's files plus gym_checkpoint.json, nothing more
    assert run["backend_files"] == run["embedded_files"] + 1
    assert run["backend_bytes"] == run["embedded_bytes"] + run["manifest_bytes"]
    assert run["backend_events_per_save"] == run["embedded_events_per_save"]
    # RL's per-actor calls over quiesce: the same save, RL's manifest, and one renewal round more
    actors = run["samples"]["actors"]["wall_s"]
    assert len(actors) == 3
    assert run["actors_extra_s"] == pytest.approx(statistics.median(actors) - statistics.median(embedded))
    assert run["actors_files"] == run["embedded_files"] + 1
    assert run["actors_events_per_save"] > run["embedded_events_per_save"]
