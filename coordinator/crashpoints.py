"""Test-only crash points: the coordinator kills itself with SIGKILL at a chosen instant.

**For tests and the crash matrix (`tools/crashmatrix.py`) only — never set these in production.**

- `QUIESCE_CRASH_AT=<n>`: SIGKILL right after the coordinator's n-th committed ledger append
  (1 is its `coordinator.started`; every `Ledger.append` / `append_many` / `stage` counts once,
  a staged event when the transaction that carries it — the next append's — has committed).
- `QUIESCE_CRASH_BEFORE_SEND=<n>`: SIGKILL right before its n-th POST control request goes out:
  its `call.sent` is committed (calls.py records before it sends), the request is not sent.
  Reads (GET) do not count: their `call.sent` is staged and committed after them, and the
  instant before a read is the instant after the append before it. Both hang off the ledger's
  `after_append` hook, because the instant after a POST's `call.sent` commit *is* the instant
  before that request leaves.

The variables are read once, when a coordinator opens (`from_env`); when neither is set nothing
is installed, so an ordinary run pays nothing — no hook, no counter, no environment lookup per
append or per call. SIGKILL (not an exception, not `os._exit`) is the point: no `finally`, no
cleanup, no flush — exactly what an OOM kill leaves behind. The ledger's append is committed
before its hook runs (durable, or write-behind: in the WAL, which a process crash keeps), so
"after the n-th append" means the n-th event batch survives — with the rest of its transaction
when the n-th was a staged event.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from quiesce.coordinator.errors import ConfigError
from quiesce.ledger import Event, Ledger

__all__ = ["CRASH_AT", "CRASH_BEFORE_SEND", "CrashPoints", "from_env", "is_send_point"]

CRASH_AT: Final = "QUIESCE_CRASH_AT"
CRASH_BEFORE_SEND: Final = "QUIESCE_CRASH_BEFORE_SEND"


def _die(what: str) -> None:
    sys.stderr.write(f"quiesce: test crash point reached ({what}); SIGKILL\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class CrashPoints:
    """Counters for one coordinator; `install` hooks them into its ledger."""

    at_append: int | None = None
    before_send: int | None = None
    appends: int = field(default=0, init=False)
    sends: int = field(default=0, init=False)

    def after_append(self, events: Sequence[Event]) -> None:
        """The ledger hook: count appends and POST `call.sent` events; die at the chosen one."""
        self.appends += 1
        if self.appends == self.at_append:
            _die(f"{CRASH_AT}={self.at_append}, after {events[-1].kind} seq {events[-1].seq}")
        if self.before_send is not None:
            for event in events:
                if is_send_point(event.kind, event.data):
                    self.sends += 1
                    if self.sends == self.before_send:
                        _die(f"{CRASH_BEFORE_SEND}={self.before_send}, {event.call_id} not sent")

    def install(self, ledger: Ledger) -> None:
        """Hook the counters into `ledger` (before its first append, so `coordinator.started` is 1)."""
        ledger.after_append = self.after_append


def is_send_point(kind: str, data: Mapping[str, object]) -> bool:
    """Whether `QUIESCE_CRASH_BEFORE_SEND` counts an event of `kind` with payload `data`: a POST's
    `call.sent` (the crash matrix counts its send points by the same rule)."""
    return kind == "call.sent" and data.get("method") == "POST"


def _read(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{name}={raw!r}: a test crash point must be a positive integer (or unset)")
    return value


def from_env(environ: Mapping[str, str] | None = None) -> CrashPoints | None:
    """The crash points the environment asks for, or None when neither variable is set."""
    env = os.environ if environ is None else environ
    at_append, before_send = _read(env, CRASH_AT), _read(env, CRASH_BEFORE_SEND)
    if at_append is None and before_send is None:
        return None
    return CrashPoints(at_append, before_send)
