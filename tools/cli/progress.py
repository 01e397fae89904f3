"""Progress of a command that drives a cluster, on stderr, from the coordinator's `Progress` reports.

- stderr is a terminal: one live line (rich) — the attempt, its phase, N/M servers acknowledged
  in the phase, the server being called (or the requests still in flight while the policy model
  drains), the time elapsed since the command started and the time left to the phase's
  deadline; a failed phase is printed above it when it fails.
- Otherwise (a pipe, a batch or SLURM log): one plain line per phase start, per phase end and
  per failed phase, each flushed as it is written — a log shows where a long command is, and
  where it stopped, even if the job is killed.

Reports carry no secret (server names, phases, error texts the coordinator wrote), and nothing
here changes what a command prints on stdout.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, TextIO

from quiesce.coordinator.wording import count
from quiesce.tools.audit.timefmt import duration
from quiesce.tools.cli import output
from quiesce.tools.cli.safe_text import markup, one_line

if TYPE_CHECKING:
    from rich.text import Text

    from quiesce.coordinator import Progress


#: How the coordinator words a phase the command's own cancellation (a signal) interrupted.
_CANCELLED: Final = re.compile(
    r"interrupted by CancelledError: Cancelled via cancel scope [0-9a-f]+(?: by <.*?>)?(?:; reason: (.*))?"
)


def reason_text(error: str | None) -> str:
    """A failed phase's reason as the line shows it: safe (`safe_text.one_line`), and a
    cancellation by a signal said as `interrupted: SIGTERM received by the command`."""
    if error is None:
        return "no reason given"
    found = _CANCELLED.fullmatch(error)
    if found is not None:
        error = f"interrupted: {found.group(1) or 'cancelled'}"
    return one_line(error)


def _seconds(value: float) -> str:
    """Seconds to the tenth (a deadline, an elapsed time on the live line)."""
    return f"{value:.1f}s" if value < 100 else f"{value:.0f}s"


@dataclass
class PhaseBoard:
    """What is known of the phase running now, fed report by report (`feed`)."""

    started: float = field(default_factory=time.monotonic)
    checkpoint_id: str | None = None
    phase: str | None = None
    phase_started: float = 0.0
    servers: int | None = None
    acknowledged: set[str] = field(default_factory=set)
    deadline_ts: float | None = None
    calling: str | None = None
    inflight: int | None = None
    failed: set[tuple[str, str]] = field(default_factory=set)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def counted(self) -> str:
        """`N/M acknowledged` for a phase addressing servers, else ``""``."""
        if self.servers is None:
            return ""
        return f"{len(self.acknowledged)}/{self.servers} acknowledged"

    def deadline_left(self) -> str:
        if self.deadline_ts is None:
            return ""
        left = self.deadline_ts - time.time()
        return f"deadline in {_seconds(left)}" if left > 0 else "deadline passed"

    def feed(self, report: Progress) -> str | None:
        """Take one report; returns the plain line it deserves (phase start, end, failure) or None."""
        step = report.step
        if step == "phase":
            self.checkpoint_id, self.phase = report.checkpoint_id, report.phase
            self.phase_started = time.monotonic()
            self.servers, self.deadline_ts = report.servers, report.deadline_ts
            self.acknowledged = set()
            self.calling = self.inflight = None
            what = [count(report.servers, "server")] if report.servers is not None else []
            what += [self.deadline_left()] if report.deadline_ts is not None else []
            return f"{one_line(report.phase)} started" + (f": {', '.join(what)}" if what else "")
        if report.phase != self.phase or report.checkpoint_id != self.checkpoint_id:
            return None  # a report of no phase this board started (e.g. from an older caller)
        took = duration(time.monotonic() - self.phase_started)
        if step == "call":
            self.calling, self.inflight = report.server, report.inflight
        elif step == "reply":
            if report.error is None and report.server is not None:
                self.acknowledged.add(report.server)
            if report.server == self.calling:
                self.calling = None
        elif step == "done":
            self.calling = self.inflight = None
            counted = self.counted()
            return f"{one_line(report.phase)} done in {took}" + (f": {counted}" if counted else "")
        elif step == "failed":
            key = (report.checkpoint_id, report.phase)
            if key in self.failed:
                return None  # one line per failed phase
            self.failed.add(key)
            where = f" at {one_line(report.server)}" if report.server else ""
            return f"{one_line(report.phase)} FAILED{where} after {took}: {reason_text(report.error)}"
        return None

    def status(self) -> str:
        """The live line's text, computed when it is drawn (elapsed and deadline keep moving)."""
        if self.phase is None:
            return f"starting… · {_seconds(self.elapsed())} elapsed"
        parts = [one_line(f"{self.checkpoint_id} {self.phase}")]
        counted = self.counted()
        if counted:
            parts.append(counted)
        if self.inflight is not None:
            parts.append(f"draining, {self.inflight} in flight")
        elif self.calling:
            parts.append(f"calling {one_line(self.calling)}")
        parts.append(f"{_seconds(self.elapsed())} elapsed")
        left = self.deadline_left()
        if left:
            parts.append(left)
        return " · ".join(parts)


class _LiveText:
    """A renderable whose text is recomputed at every refresh of the live line."""

    def __init__(self, board: PhaseBoard) -> None:
        self._board = board

    def __rich__(self) -> Text:
        from rich.text import Text

        return Text(self._board.status())


class ProgressLine:
    """The coordinator's progress callback: feeds a `PhaseBoard` and shows it (see the module
    docstring). Silent when `enabled` is False."""

    def __init__(self, *, live: bool, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.board = PhaseBoard()
        self._live = live
        self._enabled = enabled
        self._stream = stream

    def __call__(self, report: Progress) -> None:
        line = self.board.feed(report)
        if line is None or not self._enabled:
            return
        if self._live:
            if report.step == "failed":
                from rich.markup import escape

                # every piece of `line` is safe already (`feed`): only its markup is escaped here
                output.err_console.print(f"[bold red]✗[/] {markup(report.checkpoint_id)} {escape(line)}")
            return
        stream = self._stream if self._stream is not None else sys.stderr
        stamp = time.strftime("%H:%M:%S", time.gmtime())
        stream.write(f"quiesce {stamp}Z {one_line(report.checkpoint_id)} {line}\n")
        stream.flush()


@contextmanager
def progress_line(enabled: bool = True) -> Iterator[ProgressLine]:
    """A `ProgressLine` for the block: live on a terminal, plain lines otherwise (rich is loaded
    only for the live line)."""
    live = enabled and sys.stderr.isatty()
    line = ProgressLine(live=live, enabled=enabled)
    if not live:
        yield line
        return
    with output.err_console.status(_LiveText(line.board)):
        yield line
