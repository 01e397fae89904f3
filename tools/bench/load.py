"""What else the machine was doing while a run or a measure ran — recorded beside every figure, so
a figure taken on a busy machine is never read as a quiet one.

``LoadWatch`` (a context manager) records, from its start to its end:

- ``load1_start`` / ``load1_max``: ``/proc/loadavg``'s one-minute load average at the start and the
  largest value sampled (every ``SAMPLE_S``). It counts the bench's own processes too (a 512-server
  cluster of #11 keeps it above 2 on its own) and lags by a minute, so it is context, not the rule.
- ``cpu_pressure``: the share of the wall time during which some runnable task waited for a CPU
  (``/proc/pressure/cpu``, ``some total``; None where the kernel has no PSI).
- ``foreign_cores``: CPU the machine spent outside the bench's own process tree (this process and
  every descendant, live or reaped), per second of wall time — what other users of the machine
  took. It is the busy time of ``/proc/stat`` minus the tree's user + system time (a reaped
  child's time is in its parent's ``cutime``/``cstime``), so it does not grow with the bench's
  own load.

The rule (``Load.loaded``): a run during which other processes took more than
``LOADED_SHARE`` of the machine's cores on average is *loaded*; a measure any of whose runs was
loaded is reported, but its goal is not judged from it (``__main__``), and ``latest.md`` says so.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

#: Seconds between samples of the load average.
SAMPLE_S: Final = 1.0
#: Other processes' average CPU, as a share of the cores, above which a run is loaded.
LOADED_SHARE: Final = 0.25


def _clock_tick() -> int:
    return os.sysconf("SC_CLK_TCK")


def load1() -> float | None:
    """The one-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def cpu_some_us() -> int | None:
    """``/proc/pressure/cpu``'s ``some total`` (microseconds some task waited for a CPU), or None."""
    try:
        with open("/proc/pressure/cpu", encoding="ascii") as pressure:
            for line in pressure:
                if line.startswith("some "):
                    return int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine spent busy since boot (``/proc/stat``: user, nice, system,
    irq, softirq, steal), or None where there is no ``/proc/stat``."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _clock_tick()


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            # the command name (field 2) may hold spaces: split after its closing parenthesis
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def tree_pids(root: int) -> list[int]:
    """``root`` and every live descendant of it."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) is not None:
            try:
                parents[int(entry)] = int(fields[1])
            except (ValueError, IndexError):
                continue
    found, index = [root], 0
    while index < len(found):
        found += [pid for pid, parent in parents.items() if parent == found[index]]
        index += 1
    return found


def tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of ``root`` and every descendant alive now, each with the time of
    the children it has reaped (``cutime`` + ``cstime``): the tree's CPU, gone members included."""
    ticks = 0
    for pid in tree_pids(root):
        fields = _stat_fields(pid)
        if fields is not None:
            ticks += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / _clock_tick()


@dataclass(frozen=True)
class Load:
    """What ``LoadWatch`` recorded (see the module docstring); ``cores`` is the machine's."""

    wall_s: float
    cores: int
    load1_start: float | None
    load1_max: float | None
    cpu_pressure: float | None
    foreign_cores: float | None
    #: The bench's own tree's CPU per second of wall time (None where ``foreign_cores`` is).
    own_cores: float | None = None

    @property
    def loaded(self) -> bool:
        """Other processes took more than ``LOADED_SHARE`` of the cores on average."""
        return self.foreign_cores is not None and self.foreign_cores > LOADED_SHARE * self.cores

    def to_json(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "cores": self.cores,
            "load1_start": self.load1_start,
            "load1_max": self.load1_max,
            "cpu_pressure": self.cpu_pressure,
            "foreign_cores": self.foreign_cores,
            "own_cores": self.own_cores,
            "loaded": self.loaded,
        }


def merged(loads: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Several runs' ``Load`` JSON as one: the worst of each figure, loaded if any run was."""
    if not loads:
        return None

    def worst(key: str) -> float | None:
        values = [float(load[key]) for load in loads if load.get(key) is not None]
        return max(values) if values else None

    return {
        "runs": len(loads),
        "cores": loads[0]["cores"],
        "load1_max": worst("load1_max"),
        "cpu_pressure": worst("cpu_pressure"),
        "foreign_cores": worst("foreign_cores"),
        "own_cores": worst("own_cores"),
        "loaded": any(load.get("loaded") for load in loads),
    }


class LoadWatch:
    """Records a ``Load`` from entry to exit for the tree of process ``root`` (default: this one);
    ``load`` is set on exit. A background thread samples the load average."""

    def __init__(self, root: int | None = None) -> None:
        self.root = root if root is not None else os.getpid()
        self.load: Load | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="load-watch", daemon=True)
        self._load1_max: float | None = None

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._note(load1())

    def _note(self, value: float | None) -> None:
        if value is not None:
            self._load1_max = value if self._load1_max is None else max(self._load1_max, value)

    def __enter__(self) -> LoadWatch:
        self._start = time.monotonic()
        self._load1_start = load1()
        self._note(self._load1_start)
        self._some = cpu_some_us()
        self._busy = machine_busy_s()
        self._tree = tree_cpu_s(self.root)
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        wall = max(time.monotonic() - self._start, 1e-9)
        self._note(load1())
        some, busy = cpu_some_us(), machine_busy_s()
        pressure = (some - self._some) / 1e6 / wall if some is not None and self._some is not None else None
        foreign = own = None
        if busy is not None and self._busy is not None:
            own = (tree_cpu_s(self.root) - self._tree) / wall
            foreign = max(0.0, (busy - self._busy) / wall - own)
        self.load = Load(
            wall_s=wall,
            cores=os.cpu_count() or 1,
            load1_start=self._load1_start,
            load1_max=self._load1_max,
            cpu_pressure=None if pressure is None else min(1.0, max(0.0, pressure)),
            foreign_cores=foreign,
            own_cores=own,
        )
