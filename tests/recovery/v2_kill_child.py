"""A `quiesce` command that SIGKILLs itself at a chosen instant, for `test_v2_sigkill.py`.

    QUIESCE_TEST_KILL='{"kind": "call.sent", "server": "agent", "path": "/prepare"}' \\
        python -m tests.recovery.v2_kill_child checkpoint --config CONFIG

The JSON names the event to die at: `kind`, and optionally `server`, `phase` (the payload's),
`path` (a suffix of the payload's), `nth` (the n-th match, default 1) and `when`:
- `committed` (default): right after the event is durable in the ledger (the crash points' own
  hook; for a POST's `call.sent` that is the instant before its request leaves);
- `staged`: the moment the coordinator stages it (before the next step runs; e.g. `attempt.publishing`
  is staged after every commit reply was verified and right before the snapshot is renamed into place).
SIGKILL, as `QUIESCE_CRASH_AT` does: no `finally`, no rollback, no flush.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from quiesce.coordinator import crashpoints
from quiesce.ledger import Event, Ledger
from quiesce.tools.cli.main import main as cli_main

VARIABLE = "QUIESCE_TEST_KILL"


def _die(what: str) -> None:
    sys.stderr.write(f"v2_kill_child: {what}; SIGKILL\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class _Matcher:
    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.spec = spec
        self.seen = 0

    def hit(self, kind: str, server: str | None, data: Mapping[str, Any]) -> bool:
        spec = self.spec
        if kind != spec["kind"]:
            return False
        if "server" in spec and server != spec["server"]:
            return False
        if "phase" in spec and data.get("phase") != spec["phase"]:
            return False
        if "path" in spec and not str(data.get("path", "")).endswith(spec["path"]):
            return False
        self.seen += 1
        return self.seen == int(spec.get("nth", 1))


class _KillOnCommit(crashpoints.CrashPoints):
    def __init__(self, matcher: _Matcher) -> None:
        super().__init__(None, None)
        self.matcher = matcher

    def after_append(self, events: Sequence[Event]) -> None:
        for event in events:
            if self.matcher.hit(event.kind, event.server, event.data):
                _die(f"after {event.kind} seq {event.seq} ({event.server or '-'})")


def arm(spec: Mapping[str, Any]) -> None:
    matcher = _Matcher(spec)
    if spec.get("when", "committed") == "committed":
        crashpoints.from_env = lambda environ=None: _KillOnCommit(matcher)
        return
    stage = Ledger.stage

    async def staging(self: Ledger, kind: str, *args: Any, **kwargs: Any) -> Any:
        data = kwargs.get("data") or {}
        if isinstance(data, BaseModel):
            data = data.model_dump(mode="json")
        if matcher.hit(kind, kwargs.get("server"), data):
            _die(f"staging {kind}")
        return await stage(self, kind, *args, **kwargs)

    Ledger.stage = staging  # type: ignore[method-assign]


def main() -> int:
    arm(json.loads(os.environ[VARIABLE]))
    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
