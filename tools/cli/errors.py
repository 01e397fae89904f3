"""What the command line says of an error that ends a command: one table from exception class to
a stable `code` and exit code, and the `--json` error document.

- Without a JSON output the error is one human line on stderr (`error: ...`), no traceback.
- With `--json` / `-o json|jsonl` it is one JSON document on stdout,
  `{"error": {"code", "message", "exit_code", "type", ...fields}}` (on one line for `jsonl`), and
  nothing else is printed on stdout.
- The exit code is the same either way: 2 bad usage, config or refused setup; 130 interrupted;
  1 every other failure.
- A message is shown in plain words (`wording.plain`); the control token is never in one (the
  coordinator keeps it out of every message it makes).

Codes, first matching class wins: `usage`, `config`, `missing_extra`, `discovery`, `deadline`, `phase_failed`,
`servers_held`, `snapshot`, `acknowledgement`, `fenced`, `ledger`, `busy`, `unauthorized`,
`unavailable`, `not_found`, `outcome_unknown`, `failed` (any other quiesce error), `io`,
`interrupted`, or the `code` a `flags.CommandError` carries.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quiesce.coordinator.wording import plain
from quiesce.ledger.redact import mask_url_passwords
from quiesce.tools.cli.flags import CommandError


@dataclass(frozen=True)
class ErrorReport:
    """One error as the command line reports it."""

    code: str
    exit_code: int
    message: str
    fields: dict[str, Any] = field(default_factory=dict)

    def as_json(self, kind: str) -> dict[str, Any]:
        return {
            "error": {
                "code": self.code,
                "message": self.message,
                "exit_code": self.exit_code,
                "type": kind,
                **self.fields,
            }
        }


def _table() -> list[tuple[type[BaseException], str, Callable[[Any], dict[str, Any]]]]:
    """(class, code, its fields) in the order they are matched: subclasses first."""
    from quiesce.coordinator.errors import (
        AcknowledgementError,
        ConfigError,
        DeadlineExceeded,
        DiscoveryError,
        FencedError,
        LedgerError,
        MissingExtra,
        PhaseError,
        QuiesceError,
        ServersHeld,
        SnapshotError,
    )
    from quiesce.tools.serve.errors import Busy, NotFound, OutcomeUnknown, Unauthorized, Unavailable

    def phase(e: PhaseError) -> dict[str, Any]:
        return {
            "checkpoint_id": e.checkpoint_id,
            "phase": e.phase,
            "server": e.server,
            "server_code": e.code,
            "resumed": e.resumed,
            "not_resumed": e.not_resumed,
            "latest_snapshot": e.latest_snapshot,
        }

    def none(_: Any) -> dict[str, Any]:
        return {}

    return [
        (ConfigError, "config", none),
        (MissingExtra, "missing_extra", lambda e: {"extra": e.extra, "module": e.module}),
        (
            DiscoveryError,
            "discovery",
            lambda e: {"refused": [{"server": s, "reason": mask_url_passwords(r)} for s, r in e.reasons]},
        ),
        (DeadlineExceeded, "deadline", phase),
        (PhaseError, "phase_failed", phase),
        (ServersHeld, "servers_held", lambda e: {"held": e.held}),
        (SnapshotError, "snapshot", lambda e: {"differences": e.differences}),
        (
            AcknowledgementError,
            "acknowledgement",
            lambda e: {"server": e.server, "status": e.status, "server_code": e.code},
        ),
        (
            FencedError,
            "fenced",
            lambda e: {"service": getattr(e, "service", None), "command": getattr(e, "command", None)},
        ),
        (LedgerError, "ledger", none),
        (Busy, "busy", lambda e: {"checkpoint_id": e.checkpoint_id, "operation": e.operation}),
        (Unauthorized, "unauthorized", none),
        (Unavailable, "unavailable", lambda e: {"state": e.state, "active": e.active}),
        (NotFound, "not_found", none),
        (OutcomeUnknown, "outcome_unknown", none),
        (QuiesceError, "failed", none),
    ]


def exit_code_for(error: BaseException) -> int:
    """Usage, config (a ledger URL that cannot be used too), a missing extra and refused-setup
    errors are 2; an interrupt 130; every other failure 1."""
    from quiesce.coordinator.errors import ConfigError, DiscoveryError, MissingExtra
    from quiesce.ledger.errors import LedgerUrlError

    if isinstance(error, CommandError):
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return 130
    return 2 if isinstance(error, ConfigError | DiscoveryError | MissingExtra | LedgerUrlError) else 1


def describe_os_error(error: OSError) -> str:
    where = " -> ".join(str(f) for f in (error.filename, error.filename2) if f is not None)
    what = error.strerror or str(error)
    return f"{what}: {where}" if where else what


def report(error: BaseException) -> ErrorReport:
    """The `ErrorReport` of `error` (see the module docstring for the codes); a URL's password in
    its message is hidden, as everywhere quiesce shows or stores one."""
    described = _report(error)
    return dataclasses.replace(described, message=mask_url_passwords(described.message))


def _report(error: BaseException) -> ErrorReport:
    code = exit_code_for(error)
    if isinstance(error, CommandError):
        return ErrorReport(error.code, code, plain(str(error)), dict(error.fields))
    if isinstance(error, KeyboardInterrupt):
        return ErrorReport("interrupted", code, "interrupted")
    if isinstance(error, OSError):
        files = [str(f) for f in (error.filename, error.filename2) if f is not None]
        return ErrorReport("io", code, describe_os_error(error), {"files": files, "errno": error.errno})
    for cls, name, fields in _table():
        if isinstance(error, cls):
            return ErrorReport(name, code, plain(str(error)), fields(error))
    return ErrorReport("failed", code, plain(str(error)))


def emit(error: BaseException | ErrorReport, output: str | None) -> int:
    """Report `error` (a JSON document on stdout for `output` json/jsonl, else the human line on
    stderr); returns its exit code."""
    described = error if isinstance(error, ErrorReport) else report(error)
    kind = "UsageError" if isinstance(error, ErrorReport) else type(error).__name__
    if output in ("json", "jsonl"):
        document = described.as_json(kind)
        if output == "jsonl":
            sys.stdout.write(json.dumps(document, sort_keys=True, default=str) + "\n")
        else:
            sys.stdout.write(json.dumps(document, indent=2, sort_keys=True, default=str) + "\n")
        sys.stdout.flush()
    else:
        from quiesce.tools.cli.output import carries_replies, print_error  # rich: only when needed

        single = isinstance(error, ErrorReport) or carries_replies(error)
        print_error(described.message, one_line=single)
    return described.exit_code
