"""The shared harness of ``python -m quiesce.tools.bench``: a child process per run, statistics, the machine.

Every repetition of a measure runs in a fresh child process (``python -m quiesce.tools.bench.child``), so
that its peak memory is its own: the child reports ``VmHWM`` from ``/proc/self/status`` (the peak
resident set size; ``ru_maxrss`` where ``/proc`` is missing) next to its result. A measure
collects the per-run figures and reports, for each, the median of the runs with the minimum and
the maximum (``Stats``).

Timings are compared only with baselines measured in the same run, interleaved where possible,
because the machine is shared and noisy; nothing here judges an absolute time except the goals
that the issue states in absolute terms (events/s, seconds at 512 participants).
"""

from __future__ import annotations

import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quiesce.tools.bench.load import LoadWatch, tree_pids

REPO_ROOT = Path(__file__).resolve().parents[2]


class BenchError(RuntimeError):
    """A run could not be measured (a child failed, a tool is missing)."""


@dataclass(frozen=True)
class Stats:
    """Median, minimum and maximum of the per-run values of one figure."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if not values:
            raise ValueError("no values")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def to_json(self) -> dict[str, float | int]:
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n}

    def fmt(self, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
        """``median [min–max] unit`` with every value multiplied by ``scale``."""
        low, mid, high = (f"{v * scale:,.{digits}f}" for v in (self.min, self.median, self.max))
        return f"{mid} [{low}–{high}]" + (f" {unit}" if unit else "")


def stats_of(runs: Sequence[dict[str, Any]], key: str) -> Stats:
    """``Stats`` of ``run[key]`` over the runs."""
    return Stats.of([float(run[key]) for run in runs])


def bootstrap_difference(
    a: Sequence[float], b: Sequence[float], *, resamples: int = 2000, level: float = 0.95, seed: int = 3
) -> tuple[float, float]:
    """The ``level`` bootstrap interval (percentile method) of ``median(a) - median(b)``: ``a`` and
    ``b`` resampled with replacement, each on its own, ``resamples`` times (a fixed ``seed``, so
    the same samples give the same interval)."""
    import random

    rng = random.Random(seed)
    median = statistics.median
    differences = sorted(
        median(rng.choices(a, k=len(a))) - median(rng.choices(b, k=len(b))) for _ in range(resamples)
    )
    cut = (1 - level) / 2
    return differences[int(cut * resamples)], differences[min(resamples - 1, int((1 - cut) * resamples))]


def child_env() -> dict[str, str]:
    """The environment of a child: this one, with the repository on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


#: Every run ``run_child`` made since ``__main__`` last cleared it: the raw results it publishes.
RUNS: list[dict[str, Any]] = []


def run_child(
    target: str, params: dict[str, Any], *, timeout_s: float = 600.0, tree_rss: bool = False
) -> dict[str, Any]:
    """Run ``quiesce.tools.bench.<module>.<function>(**params)`` in a fresh interpreter; its result.

    ``target`` is ``"module:function"``. The result is the function's dict plus ``peak_rss_mb``
    (the child's VmHWM) and ``wall_s`` (the child's whole lifetime, seen from here). With
    ``tree_rss`` also ``tree_peak_rss_mb``: the largest summed RSS of the child and every process
    it started, sampled from here (``TreeRss``), and ``tree_processes``, the most seen at once.
    Every result also carries ``load`` (``LoadWatch``: what else the machine did meanwhile) and
    is kept in ``RUNS``, which ``__main__`` publishes with the measure (its raw runs).
    """
    started = time.perf_counter()
    watch = LoadWatch()
    watch.__enter__()
    process = subprocess.Popen(
        [sys.executable, "-m", "quiesce.tools.bench.child", target, json.dumps(params)],
        cwd=str(REPO_ROOT),
        env=child_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sampler = TreeRss(process.pid) if tree_rss else None
    try:
        if sampler is not None:
            sampler.__enter__()
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired as error:
            process.kill()
            process.communicate()
            raise BenchError(f"{target} did not finish within {timeout_s:.0f} s") from error
    finally:
        if sampler is not None:
            sampler.__exit__()
        watch.__exit__(None, None, None)
    if process.returncode != 0:
        tail = "\n".join((stderr or stdout).strip().splitlines()[-15:])
        raise BenchError(f"{target} exited with {process.returncode}:\n{tail}")
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise BenchError(f"{target} printed no result:\n{stdout[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    result["wall_s"] = time.perf_counter() - started
    if sampler is not None:
        result["tree_peak_rss_mb"] = sampler.peak_mb
        result["tree_processes"] = sampler.most_processes
    assert watch.load is not None
    result["load"] = watch.load.to_json()
    RUNS.append({"target": target, **result})
    return result


def run_cli(
    args: Sequence[str], *, env: dict[str, str] | None = None, timeout_s: float = 600.0
) -> dict[str, Any]:
    """Run ``quiesce ARGS`` in a fresh interpreter that imports only the CLI (``clichild``).

    Returns ``exit``, ``stdout``, ``peak_rss_mb`` and ``process_cpu_s`` (reported by that process
    about itself) and ``wall_s``, spawn to exit seen from here: Python's start-up and the CLI's
    imports, not the bench's. A non-zero exit raises ``BenchError`` with the output's tail.
    """
    with tempfile.TemporaryDirectory(prefix="quiesce-bench-cli-") as scratch:
        report = Path(scratch) / "report.json"
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "quiesce.tools.bench.clichild", str(report), *args],
            cwd=str(REPO_ROOT),
            env={**child_env(), **(env or {})},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        wall = time.perf_counter() - started
        if done.returncode != 0 or not report.exists():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            raise BenchError(f"quiesce {' '.join(args[:1])} exited {done.returncode}:\n{tail}")
        result: dict[str, Any] = json.loads(report.read_text(encoding="utf-8"))
    result["stdout"] = done.stdout
    result["wall_s"] = wall
    return result


def repeat(
    target: str,
    params: dict[str, Any],
    runs: int,
    *,
    timeout_s: float = 600.0,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """``runs`` results of ``run_child(target, params)``, one fresh process each."""
    out = []
    for index in range(runs):
        result = run_child(target, params, timeout_s=timeout_s)
        out.append(result)
        if log is not None:
            log(f"  run {index + 1}/{runs} of {target} done in {result['wall_s']:.1f} s")
    return out


@dataclass
class Result:
    """What one measure reports (``latest.json`` holds one per measure, ``latest.md`` a row each).

    ``status`` is ``ok``, ``unavailable`` (could not be measured here; ``reason`` says why) or
    ``error`` (the bench itself failed; ``reason`` holds the error). ``met`` is None unless ok.
    ``value`` is the figure compared with the goal, ``baseline`` what it was compared with.
    ``metrics`` holds every figure as ``Stats`` JSON plus a ``unit``; ``rows`` optional detail.
    """

    id: int
    title: str
    goal: str
    status: str = "ok"
    met: bool | None = None
    value: str = ""
    baseline: str = ""
    reason: str | None = None
    runs: int = 0
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Each side of the comparison and its settings (durability, transport, order, ...): one dict
    #: per side, with a ``side`` key; ``latest.md`` prints them so a reader can rerun either side.
    settings: list[dict[str, str]] = field(default_factory=list)
    #: What else the machine did during the measure (``load.merged`` of its runs, or of the
    #: whole measure when it made no child run); set by ``__main__``.
    load: dict[str, Any] | None = None
    #: Every run's raw result (``RUNS``): the samples behind each figure, for re-analysis.
    raw: list[dict[str, Any]] = field(default_factory=list)

    def side(self, side: str, **settings: str) -> None:
        """Record one side of the comparison and the settings it ran with."""
        self.settings.append({"side": side, **settings})

    def metric(self, name: str, stats: Stats, unit: str) -> None:
        self.metrics[name] = {**stats.to_json(), "unit": unit}

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "goal": self.goal,
            "status": self.status,
            "met": self.met,
            "value": self.value,
            "baseline": self.baseline,
            "reason": self.reason,
            "runs": self.runs,
            "metrics": self.metrics,
            "rows": self.rows,
            "notes": self.notes,
            "settings": self.settings,
            "load": self.load,
            "raw": self.raw,
        }


@dataclass
class Context:
    """Options of one bench run, shared by every measure."""

    quick: bool
    runs: int
    work: Path  #: a temporary folder for this run (removed at the end)
    cache: Path  #: kept between runs (generated ledgers); under ``bench-results/.cache``
    dbos_venv: Path | None = None  #: reuse (or create) the DBOS venv here instead of a temp dir
    sizes: tuple[int, ...] = ()  #: measures #4's and #11's N values (empty: the default)
    log: Callable[[str], None] = field(default=lambda text: print(text, file=sys.stderr, flush=True))


# -- the machine ------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gb() -> float | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return None


def _disk(path: Path) -> str:
    """The device, filesystem and (when known) SSD/rotational kind of the filesystem holding ``path``."""
    best = ("", "", "")
    try:
        target = str(path.resolve())
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                device, point, fstype = line.split()[:3]
                if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(
                    best[1]
                ):
                    best = (device, point, fstype)
    except OSError:
        return "unknown"
    device, point, fstype = best
    kind = ""
    name = Path(device).name.rstrip("0123456789")
    rotational = Path(f"/sys/block/{name}/queue/rotational")
    if rotational.exists():
        kind = ", rotational" if rotational.read_text().strip() == "1" else ", non-rotational"
    total = ""
    try:
        st = os.statvfs(path)
        total = f", {st.f_blocks * st.f_frsize / 1e9:.0f} GB"
    except OSError:
        pass
    return f"{device} ({fstype} on {point}{kind}{total})"


def commit() -> str:
    """The repository's commit (``git rev-parse HEAD``), with ``+dirty`` when tracked files differ."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


def machine(work: Path) -> dict[str, Any]:
    """What the numbers were measured on."""
    ram = _ram_gb()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_gb": round(ram, 1) if ram is not None else None,
        "disk": _disk(work),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "load_avg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


# -- other processes ----------------------------------------------------------------------------


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``, all its threads)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        # the command name (field 2) may hold spaces: split after its closing parenthesis
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    """The current resident set size of ``pid`` in MB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class TreeRss:
    """Samples the summed RSS of a process and all its descendants (a background thread).

    ``peak_mb`` is the largest sum seen: every process's resident memory at one instant, added up —
    what the machine must hold at once. The RSS of the known processes is read every
    ``interval_s``; the process tree is walked (every ``/proc/*/stat``) only every ``rescan_s``, so
    the sampler itself costs little CPU. A spike shorter than ``interval_s``, or a process that
    lives less than ``rescan_s``, can be missed; each process's own VmHWM bounds its part.
    """

    def __init__(self, root: int, interval_s: float = 0.05, rescan_s: float = 0.25) -> None:
        import threading

        self.root = root
        self.peak_mb = 0.0
        self.most_processes = 0
        self._interval_s = interval_s
        self._rescan_s = rescan_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-rss", daemon=True)

    def _run(self) -> None:
        pids: list[int] = []
        scanned = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - scanned >= self._rescan_s:
                pids, scanned = tree_pids(self.root), now
            total = sum(rss_mb(pid) for pid in pids)
            self.peak_mb = max(self.peak_mb, total)
            self.most_processes = max(self.most_processes, len(pids))
            self._stop.wait(self._interval_s)

    def __enter__(self) -> TreeRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


#: The longest a bench waits for a ledger's background upkeep between two timed windows.
UPKEEP_WAIT_S = 30.0


async def upkeep_settled(ledger: object) -> None:
    """Wait (untimed) until ``ledger``'s SQLite WAL upkeep has nothing pending or running
    (``quiesce.ledger.sqlite_upkeep``): called after each timed save of a side whose ledger has
    one, so that side's background fsync and checkpoint never overlap another side's timed window
    (which they would slow, flattering the side that caused them) nor its own next one. A ledger
    without an upkeep (PostgreSQL, the null ledger) returns at once."""
    backend = getattr(ledger, "backend", ledger)
    settled = getattr(backend, "upkeep_settled", None)
    if settled is None:
        return
    import anyio.to_thread

    if not await anyio.to_thread.run_sync(settled, UPKEEP_WAIT_S):
        raise BenchError(f"the ledger's WAL upkeep was still busy {UPKEEP_WAIT_S:.0f} s after a save")
