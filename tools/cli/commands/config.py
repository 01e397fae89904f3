"""`quiesce config check --config C [--servers] [-o FORMAT]` — is this config ready for a save?

Offline (no Gym server contacted): the extras this install has and the driver the ledger URL
needs; the ledger (read-only: its folder exists, an existing one is at this version's schema); the
snapshots folder (the preflight a save runs: it may create the folder and writes one probe file,
removed); the control token (set, and usable as a bearer token — never shown). With `--servers`
also each server: reachable, the checkpoint control plane it speaks (v1, or the unified plane),
and whether it accepts the token on an authenticated read. Records nothing, takes no epoch
(rules: `coordinator/configcheck.py`).

Exit 0 when every check passed, 2 when an offline check failed (the setup: fix the config, the
install, the folders or the token), 1 when a server check failed. `--json`: `{"ok", "checks":
[{"scope", "name", "ok", "detail", "plane", "role", "warnings"}]}`; `-o jsonl`: one check per line.
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from quiesce.coordinator.config import load_config
from quiesce.coordinator.configcheck import ConfigReport, check_config
from quiesce.tools.cli.flags import Commands, add_config, add_output
from quiesce.tools.cli.output import console, emit_json, emit_jsonl


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "config",
        help="check a cluster config: ledger, snapshots folder, token, extras (and the servers)",
        description="Check a cluster config before a save needs it.",
    )
    actions = Commands(parser.add_subparsers(dest="config_command", metavar="ACTION", required=True))
    check = actions.add_parser(
        "check",
        help="check the config offline; --servers also asks every server",
        description="Check the config offline (ledger, snapshots folder, token, extras); with --servers"
        " also each server: reachable, its control plane, the token accepted. Records nothing.",
    )
    add_config(check)
    add_output(check)
    check.add_argument(
        "--servers",
        action="store_true",
        help="also ask every server: reachable, which control plane, the token accepted",
    )
    check.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    report = anyio.run(lambda: check_config(config, servers=args.servers))
    if args.output == "jsonl":
        emit_jsonl(check.as_json() for check in report.checks)
    elif args.json:
        emit_json(report.as_json())
    else:
        _print(report)
    return report.exit_code


def _print(report: ConfigReport) -> None:
    from rich.table import Table

    from quiesce.tools.cli.safe_text import escape

    table = Table(box=None, pad_edge=False, show_edge=False)
    table.add_column("check", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("plane", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for check in report.checks:
        result = "[green]ok[/]" if check.ok else "[bold red]FAILED[/]"
        detail = escape(check.detail) + "".join(f"\n[yellow]warning:[/] {escape(w)}" for w in check.warnings)
        table.add_row(escape(check.name), result, escape(check.plane or ""), detail)
    console.print(table)
    verdict = {0: "every check passed", 1: "a server check failed", 2: "the setup needs fixing"}
    console.print(verdict[report.exit_code])
