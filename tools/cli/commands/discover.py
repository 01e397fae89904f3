"""`quiesce discover --config C [--json]` — participants, skipped and refused servers, with reasons.

Exit 0 when the cluster can take part, 2 when discovery refuses it (every reason is listed).
Needs no control token (capabilities are public): without one the coordinator is opened read-only
(no Authorization header, no recovery); the token is sent when it is set. A token that cannot be
a bearer token is a config error (exit 2), as for every command.
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio
from rich.markup import escape
from rich.table import Table

from quiesce.coordinator import Coordinator, Discovery, load_config
from quiesce.tools.cli.cluster_cmd import add_common, print_warnings
from quiesce.tools.cli.output import console, emit_json


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "discover",
        help="list participants, skipped and refused servers",
        description="Ask every configured server for its capabilities and apply the participation rules.",
    )
    add_common(parser)
    parser.set_defaults(handler=handle)


def _print(found: Discovery) -> None:
    table = Table(title="participants", title_justify="left")
    for column in ("name", "component", "checkpoint_mode", "instance_role", "role"):
        table.add_column(column)
    for m in found.participants:
        table.add_row(m.name, m.component, m.checkpoint_mode, m.instance_role or "-", m.role)
    console.print(table)
    for title, rows in (("skipped", found.skipped), ("refused", found.refused)):
        if rows:
            console.print(f"[bold]{title}[/]")
            for name, reason in rows:
                console.print(f"  {escape(name)}: {escape(reason)}", soft_wrap=True)


def handle(args: argparse.Namespace) -> int:
    config = load_config(args.config)

    async def run() -> Discovery:
        async with Coordinator.open(config, require_token=False) as coord:
            return await coord.discover(strict=False)

    found = anyio.run(run)
    if args.json:
        emit_json(found.as_json())
    else:
        _print(found)
    print_warnings(found.warnings)
    return 2 if found.refused else 0
