"""`quiesce conformance URL [--plane v1|v2] [--lease-check] [-o FORMAT]` — probe one Gym server
for compliance with its checkpoint control plane.

The plane is detected (a v1 server answers `GET /ng-control/v1/capabilities`; a v2 participant
answers it 404 and answers `GET /ng-control/v1/checkpoint/status` with a valid status) unless
`--plane` names it; `--lease-check` (v2) also waits out one lease of a server with a short grace.
Prints one row per check (pass / fail with a short reason / skip with why / warn: the rule holds
in a way worth fixing), or one JSON document with `--json`, or one check per line with `-o jsonl`.
Exit codes: 0 no check failed (skips and warnings allowed), 1 at least one failed, 2 bad usage
(token variable unset, URL unreachable). The token is read from an environment variable and never
printed.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import anyio
from rich.table import Table

from quiesce.coordinator.calls import token_problem
from quiesce.coordinator.protocol import TOKEN_ENV, TOKEN_ENV_FALLBACK
from quiesce.coordinator.wording import count, plain
from quiesce.tools.cli.flags import UsageError, add_output
from quiesce.tools.cli.output import console, emit_json, emit_jsonl
from quiesce.tools.cli.safe_text import escape
from quiesce.tools.conformance import DEFAULT_TIMEOUT_S
from quiesce.tools.conformance_report import ConformanceReport, ServerUnreachable
from quiesce.tools.conformance_v2 import LEASE_CHECK_MAX_GRACE_S, check_server

_STYLE = {
    "pass": "[green]pass[/]",
    "fail": "[bold red]FAIL[/]",
    "skip": "[yellow]skip[/]",
    "warn": "[bold yellow]warn[/]",
}


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "conformance",
        help="check one Gym server against its checkpoint control plane (v1 or unified)",
        description=(
            "Probe a Gym server for compliance with its checkpoint control plane, detected or named by"
            " --plane: v1 (policy model, agent or resources: capabilities, auth, validation, the fence"
            " rules, a prepare/commit/resume cycle) or the unified plane v2 (any participant kind:"
            " status, auth, validation, phases, a prepare/renew/commit/resume cycle with its storage"
            " layout, deadlines, retire and forget; restore only by its refusals). Commits go into a"
            " temp dir. The server is left idle afterwards."
        ),
    )
    parser.add_argument("url", metavar="URL", help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--token-env",
        metavar="NAME",
        default=None,
        help=f"variable holding the control token (default {TOKEN_ENV}, then {TOKEN_ENV_FALLBACK})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds to wait for a reply; also each control call's budget (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--plane",
        choices=("v1", "v2"),
        default=None,
        help="the control plane to check (default: detect it)",
    )
    parser.add_argument(
        "--lease-check",
        action="store_true",
        help=(
            "v2: also prepare with a near deadline and wait until the lease resumes the server (needs a"
            f" server whose lease grace is at most {LEASE_CHECK_MAX_GRACE_S:g}s; skipped otherwise)"
        ),
    )
    add_output(parser)
    parser.set_defaults(handler=handle)


def read_token(token_env: str | None) -> tuple[str | None, str]:
    """The token and where it came from; None with a message naming what to set when it is unset
    or cannot be a bearer token."""
    names = [token_env] if token_env else [TOKEN_ENV, TOKEN_ENV_FALLBACK]
    for name in names:
        value = os.environ.get(name)
        if value:
            problem = token_problem(value)
            if problem is not None:  # the value itself is never shown
                return (
                    None,
                    f"{problem} (from the environment variable {name}); set it to the bearer token alone",
                )
            return value, name
    wanted = " or ".join(names)
    return None, f"no control-plane token: set {wanted} (or name another variable with --token-env)"


def handle(args: argparse.Namespace) -> int:
    token, source = read_token(args.token_env)
    if token is None:
        raise UsageError(source)
    if args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g}: give a number of seconds above 0")
    try:
        report = anyio.run(
            lambda: check_server(
                args.url, token, plane=args.plane, timeout_s=args.timeout, lease_check=args.lease_check
            )
        )
    except ServerUnreachable as error:
        raise UsageError(str(error), code="unreachable") from None
    if args.output == "jsonl":
        emit_jsonl(result.to_json() for result in report.results)
    elif args.json:
        emit_json(report.to_json())
    else:
        print_report(report)
    return 0 if report.passed else 1


def print_report(report: ConformanceReport) -> None:
    what = " ".join(
        escape(str(part))
        for part in (report.component, repr(report.name) if report.name else None, report.instance_role)
        if part
    )
    from quiesce.tools.audit.present import whole_column, widened

    if report.plane == "v2":
        what = f"{what}, unified plane" if what else "unified plane"
    table = Table(title=f"conformance of {escape(report.url)}" + (f" ({what})" if what else ""))
    whole_column(table, "check", [result.name for result in report.results])
    table.add_column("result", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for result in report.results:
        table.add_row(escape(result.name), _STYLE[result.status], escape(plain(result.detail)))
    widened(console).print(table)
    counts = report.counts()
    verdict = "[green]conformant[/]" if report.passed else "[bold red]not conformant[/]"
    warned = f", {count(counts['warn'], 'warning')}" if counts["warn"] else ""
    console.print(
        f"{verdict}: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped{warned}"
    )
