"""The bench's load record and its verdict statistic, against real processes.

`LoadWatch` must count CPU taken by processes outside the bench's own tree (another user of the
machine) and not the bench's own children; a measure run while the machine was loaded must not
claim its goal; the bootstrap interval must be reproducible and bracket the true difference.
Nothing here asserts a time the bench measures.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from quiesce.tools.bench.__main__ import judge_load
from quiesce.tools.bench.harness import Result, bootstrap_difference
from quiesce.tools.bench.load import LOADED_SHARE, Load, LoadWatch, merged, tree_cpu_s
from quiesce.tools.bench.report import render_markdown, verdict

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux's /proc")

#: Spins one core for {s} seconds of wall time.
SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"
#: Spins until it has used {s} seconds of CPU, however busy the machine is.
BURN = "import time\nwhile time.process_time() < {s}: pass\n"


@contextmanager
def foreign_spinner(seconds: float) -> Iterator[int]:
    """A process that spins one core for ``seconds`` outside this process's tree: started by a
    child that exits at once, so it is reparented and no process of this tree ever reaps it. It
    holds none of the child's pipes, so the child's output ends when the child does."""
    launcher = subprocess.run(
        [sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c',"
         f" {SPIN.format(s=seconds)!r}], start_new_session=True, stdin=subprocess.DEVNULL,"
         " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    pid = int(launcher.stdout)
    try:
        yield pid
    finally:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_foreign_cpu_is_counted_and_the_trees_own_is_not() -> None:
    with LoadWatch() as own:  # a child of this process burns 1.2 s of CPU: the bench's own work
        subprocess.run([sys.executable, "-c", BURN.format(s=1.2)], check=True)
    with foreign_spinner(2.5), LoadWatch() as other:  # someone else spins a core meanwhile
        time.sleep(1.5)
    assert own.load is not None
    assert other.load is not None
    # the own child's CPU is the tree's, so it is not in the foreign figure
    assert own.load.own_cores is not None
    assert own.load.own_cores * own.load.wall_s >= 1.15
    assert own.load.wall_s >= 1.2
    assert own.load.load1_max is not None
    # one core spun by someone else for the whole window: most of a core is foreign, not own
    assert other.load.foreign_cores is not None
    assert other.load.foreign_cores > 0.6
    assert other.load.own_cores is not None
    assert other.load.own_cores < 0.3


def test_tree_cpu_keeps_a_reaped_childs_time() -> None:
    before = tree_cpu_s(os.getpid())
    subprocess.run([sys.executable, "-c", BURN.format(s=0.6)], check=True)  # run, then reaped
    # the child used at least 0.6 s; the kernel accounts whole clock ticks, so allow one short
    assert tree_cpu_s(os.getpid()) - before >= 0.6 - 2 / os.sysconf("SC_CLK_TCK")


def _load(foreign: float, cores: int = 2) -> dict[str, object]:
    return Load(1.0, cores, 0.5, 1.0, 0.1, foreign).to_json()


def test_a_loaded_run_claims_no_goal() -> None:
    quiet = Load(1.0, 2, 0.5, 0.7, 0.05, 0.1)
    result = Result(3, "save cycle", "<= 6 ms", met=False, value="9 ms")
    judge_load(result, [{"target": "cycle:run_cycles", "load": _load(0.1)}], quiet)
    assert result.met is False  # quiet: judged as measured
    assert result.load is not None
    assert result.load["loaded"] is False

    loaded_foreign = LOADED_SHARE * 2 + 0.3
    result = Result(3, "save cycle", "<= 6 ms", met=True, value="5 ms")
    runs = [{"target": "t", "load": _load(0.1)}, {"target": "t", "load": _load(loaded_foreign)}]
    judge_load(result, runs, quiet)
    assert result.met is None
    assert result.load is not None
    assert result.load["loaded"] is True
    assert result.load["foreign_cores"] == pytest.approx(loaded_foreign)
    assert result.raw == runs
    assert result.notes[0].startswith("NOT JUDGED: the machine was loaded")
    assert "during run(s) 2" in result.notes[0]
    assert "(the goal would read: met)" in result.notes[0]
    measure = result.to_json()
    assert verdict(measure) == "**not judged: loaded**"
    document = {"command": "c", "started": "s", "seconds": 1, "runs": 2, "quick": False,
                "measures": [measure], "machine": {"cpu": "x", "cores": 2, "ram_gb": 1, "disk": "d",
                                                   "os": "o", "python": "p", "sqlite": "q"}}  # fmt: skip
    text = render_markdown(document)
    assert "**not judged: loaded**" in text
    assert "LOADED: not judged" in text


def test_a_measure_without_child_runs_is_judged_by_its_own_window() -> None:
    result = Result(8, "m", "g", met=True)
    judge_load(result, [], Load(1.0, 2, 3.0, 3.0, 0.9, 1.9))
    assert result.met is None
    assert merged([]) is None


def test_bootstrap_interval_is_reproducible_and_brackets_the_difference() -> None:
    rng = random.Random(7)
    a = [10.0 + rng.gauss(0, 1) for _ in range(101)]
    b = [7.0 + rng.gauss(0, 1) for _ in range(101)]
    low, high = bootstrap_difference(a, b)
    assert (low, high) == bootstrap_difference(a, b)  # fixed seed
    assert low < statistics.median(a) - statistics.median(b) < high
    assert low < 3.0 < high  # the true difference of the distributions
    assert high - low < 1.5
    wider = bootstrap_difference(a[:11], b[:11])
    assert wider[1] - wider[0] > high - low  # fewer samples, a wider interval
