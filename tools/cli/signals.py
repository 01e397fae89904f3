"""Signals to a command that drives a cluster (`quiesce checkpoint`, `quiesce restore`): SIGTERM, SIGHUP
and SIGINT end it the way an exception inside the attempt does, never by leaving servers paused.

- While the operation may still be undone — a save before its publication's rename, a restore
  before its restore phase ended — the signal cancels the operation's cancel scope. The
  coordinator handles that cancellation inside the attempt: a save is rolled back (every touched
  server resumed, staging removed), shielded from the cancellation and bounded by its cleanup
  budget; a restore is stopped and recorded (Gym's unified plane resumes everyone; on v1 the
  servers it contacted stay paused, since half-restored state must not run, and the message names
  both ways out).
- Once the operation is past that point — a save publishing or published, a restore whose resume
  runs — the signal is held: the resume is finished first (bounded by its own deadlines), then the
  command exits. A line on stderr says so when the signal arrives.
- A further signal while it stops changes nothing (it is said once on stderr); SIGKILL is the way
  to stop at once, and `quiesce recover` finishes what that leaves.
- The command then exits 128 + the signal's number — 143 for SIGTERM, 129 for SIGHUP — or 130
  for SIGINT, with one line naming the signal and what became of the attempt (from the ledger's
  records of this run), or one JSON document with `--json`. Through `--service` the request is
  abandoned and the line says how to see what the service did.

The signals are taken from the event loop (`anyio.open_signal_receiver`) only while the command's
`watching()` block runs; before and after it Python's defaults apply (nothing is paused then).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc

from quiesce.tools.cli import output
from quiesce.tools.cli.flags import CommandError
from quiesce.tools.cli.safe_text import markup

if TYPE_CHECKING:
    from quiesce.coordinator import Attempt
    from quiesce.ledger import Event, Ledger

#: The signals that stop a command the way an exception inside its attempt does.
SIGNALS: Final = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
#: The ledger records that say what became of an attempt this command started.
_OUTCOMES: Final = ("attempt.started", "attempt.aborted", "attempt.completed", "attempt.published")


def exit_code_of(signum: int) -> int:
    """130 for SIGINT (as for Ctrl-C), else 128 + the signal's number (SIGTERM 143, SIGHUP 129)."""
    return 130 if signum == signal.SIGINT else 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Interrupted(CommandError):
    """The command was stopped by a signal (`--json` code `interrupted`, exit `exit_code_of`)."""

    code = "interrupted"

    def __init__(self, signum: int, message: str, **fields: Any) -> None:
        super().__init__(message, exit_code=exit_code_of(signum), signal=signal_name(signum), **fields)


class SignalStop:
    """Turns the signals into a cancellation of one operation (see the module docstring).

    `watching()` takes the signals for its block; `operation(hold)` is the cancel scope a signal
    cancels — unless `hold()` returns a reason to let the operation finish (it is asked when the
    signal arrives). A signal that arrives outside `operation` is remembered: an operation opened
    after it is cancelled at once."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.held: str | None = None
        self._count = 0
        self._scope: anyio.CancelScope | None = None
        self._hold: Callable[[], str | None] = lambda: None

    @asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """Take the signals for the block. Once one was taken, the command is on its way out with
        its exit code decided: further ones are ignored from the end of the block on."""
        raised: BaseException | None = None
        async with anyio.create_task_group() as group:
            await group.start(self._watch)
            try:
                yield
            except BaseException as error:  # raised as it is below: the group would wrap it
                raised = error
            finally:
                group.cancel_scope.cancel()
        if self.received is not None:
            for signum in SIGNALS:
                signal.signal(signum, signal.SIG_IGN)
        if raised is not None:
            raise raised

    async def _watch(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        if threading.current_thread() is not threading.main_thread():
            # the command line run from another thread (a test, an embedding program): signals
            # go to the main thread only, which keeps its own handlers
            task_status.started()
            return
        with anyio.open_signal_receiver(*SIGNALS) as signals:
            task_status.started()
            async for signum in signals:
                self.take(signum)

    def take(self, signum: int) -> None:
        """One signal: cancel the operation, hold it, or (a further one) say it is still stopping."""
        self._count += 1
        if self.received is None:
            self.received = signum
        elif self._count == 2:
            _say(
                f"{signal_name(signum)} again: still stopping ({self.held or 'rolling back'}); SIGKILL stops"
                " at once and leaves the rest to `quiesce recover`"
            )
            return
        else:
            return
        if self._scope is None:
            return
        # decided on the event loop itself, between two steps of the operation: what `hold` reads
        # there is what the cancellation meets (and the coordinator records the reason, not this
        # task's description; the command line runs on asyncio: `Coordinator.open` refuses trio)
        asyncio.get_running_loop().call_soon(self._stop, signum)

    def _stop(self, signum: int) -> None:
        if self._scope is None:
            return  # the operation ended meanwhile
        self.held = self._hold()
        if self.held is None:
            self._scope.cancel(f"{signal_name(signum)} received by the command")
        else:
            _say(f"{signal_name(signum)} received: {self.held}; then this command exits")

    @contextmanager
    def operation(self, hold: Callable[[], str | None] = lambda: None) -> Iterator[None]:
        """The cancel scope a signal cancels (`hold`: see the class docstring)."""
        self._hold = hold
        with anyio.CancelScope() as scope:
            self._scope = scope
            if self.received is not None:
                scope.cancel()
            try:
                yield
            finally:
                self._scope = None


def _say(line: str) -> None:
    output.err_console.print(f"[bold yellow]warning:[/] {markup(line)}", soft_wrap=True)


async def records_since(ledger: Ledger, after: int) -> list[Event]:
    """The attempt records this command's run wrote after seq `after` (read shielded: it runs
    while the command stops)."""
    found: list[Event] = []
    with anyio.CancelScope(shield=True):
        found.extend([e async for e in ledger.read(after=after, kinds=list(_OUTCOMES))])
    return found


def _names(names: Any) -> str:
    return ", ".join(str(n) for n in names) if names else "none"


def interrupted(signum: int, records: list[Event], frees: str) -> Interrupted:
    """The error that ends a command stopped by `signum`, saying what became of the attempt the
    command started (`records`: `records_since`; `frees`: `--config C` or `--service URL`)."""
    name = signal_name(signum)
    code = exit_code_of(signum)
    head = f"interrupted by {name} (exit {code})"
    started = next((e for e in reversed(records) if e.kind == "attempt.started"), None)
    if started is None:
        return Interrupted(signum, f"{head} before any attempt started: no server was paused")
    cid = started.checkpoint_id or "?"
    kind = str(started.data.get("kind", "save"))
    word = "checkpoint" if kind == "save" else "restore"
    ended = next(
        (e for e in reversed(records) if e.checkpoint_id == cid and e.kind != "attempt.started"), None
    )
    fields: dict[str, Any] = {"checkpoint_id": cid, "kind": kind}
    if ended is not None and ended.kind == "attempt.aborted":
        resumed = list(ended.data.get("resumed") or [])
        left = list(ended.data.get("left_paused") or [])
        fields.update(outcome="aborted", resumed=resumed, left_paused=left)
        if kind == "save":
            text = f"{head}: {word} {cid} rolled back, nothing published; resumed: {_names(resumed)}"
            if left:
                text += f"; still paused: {_names(left)} — run `quiesce abort {frees} {cid}` once reachable"
        elif left:
            text = (
                f"{head}: {word} {cid} stopped; the servers it contacted stay paused (half-restored"
                f" state must not run): {_names(left)} — restart them and restore again, or run"
                f" `quiesce resume {frees} {cid}` to run them as they are"
            )
        else:
            text = f"{head}: {word} {cid} stopped and cleaned up; resumed: {_names(resumed)}"
        return Interrupted(signum, text, **fields)
    if ended is not None and ended.kind == "attempt.completed":
        outcome = str(ended.data.get("outcome", "completed"))
        fields.update(outcome=outcome, servers=list(ended.data.get("servers") or []))
        published = next(
            (e for e in records if e.kind == "attempt.published" and e.checkpoint_id == cid), None
        )
        where = f" at {published.data.get('final_dir')}" if published is not None else ""
        if kind == "save":
            text = f"{head} once {word} {cid} was published{where}: its resume was finished first"
        else:
            text = f"{head} once {word} {cid} was {outcome}: it was finished first"
        return Interrupted(signum, text, **fields)
    fields.update(outcome=None)
    return Interrupted(
        signum,
        f"{head}: {word} {cid} was left unfinished; run `quiesce recover {frees}` to finish or roll it back",
        **fields,
    )


def abandoned(signum: int, service: str) -> Interrupted:
    """The error of a command through `--service` stopped by `signum`: the request was abandoned."""
    head = f"interrupted by {signal_name(signum)} (exit {exit_code_of(signum)})"
    return Interrupted(
        signum,
        f"{head}: the request to the service at {service} was abandoned; `quiesce status --service"
        f" {service}` shows whether anything holds the servers",
    )


def past_the_point(current: Attempt | None) -> str | None:
    """Why a signal must wait for `current` (the attempt of this process) to finish: a save once it
    publishes (its rename may be done: only a resume lets its servers go), a restore once its
    restore phase ended (its resume, if asked, runs); None while cancelling it rolls it back."""
    if current is None:
        return None
    cid = current.checkpoint_id
    if current.kind == "save" and current.state in ("publishing", "published", "completed"):
        return f"checkpoint {cid} is being published; its publication and resume are finished first"
    if current.kind == "restore" and current.state in ("restored", "completed"):
        return f"restore {cid} has restored every server; its resume is finished first"
    return None
