"""`quiesce status --config C [--json]` — live: what holds each Gym server, and what frees it.

Reads every configured server's capabilities now (its fence: phase, active checkpoint id, deadline)
and looks each holding id up in the ledger: its kind (save, restore, or `unknown` when this ledger
has no such attempt — another ledger's), since when (the first request of it the server received),
and the exact command that frees the server (`coordinator/status.py` has the rules). Read-only: the
ledger is opened read-only and no epoch is taken, so a coordinator at work is never disturbed;
nothing is recorded. The control token is sent when it is set (capabilities need none, so the
report is the same without it); a token that cannot be a bearer token is a config error (exit 2).

Exit 0 when every server is reachable and idle, 1 when any is held or cannot be read, 2 on bad
usage or config. `--json`: `{"idle", "held", "servers": [{"name", "url", "reachable", "phase",
"active_checkpoint_id", "held", "held_by", "holder_kind", "since", "deadline_left_s", "frees",
"error"}],
"holders": [{"checkpoint_id", "kind", "state", "started_at", "finished", "frees"}],
"unfinished": [ID...]}`: `finished` false for an attempt `quiesce recover` would finish.
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from quiesce.coordinator import QuiesceError, load_config
from quiesce.coordinator.calls import peek_capabilities
from quiesce.coordinator.config import find_token
from quiesce.coordinator.http import HttpClient
from quiesce.coordinator.status import ClusterStatus, read_status
from quiesce.ledger import Ledger
from quiesce.tools.cli import output
from quiesce.tools.cli.cluster_cmd import add_common, escape, print_warnings
from quiesce.tools.cli.output import emit_json


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "status",
        help="live: each server's fence, what holds it and the command that frees it",
        description="Read every server's fence now; name what holds each one, since when, and what frees it.",
    )
    add_common(parser)
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    # the report reads only capabilities, which need no token (the status routes do): without
    # one it is complete; a token that cannot be a bearer token is still a config error
    token = find_token(config)
    warnings: list[str] = []

    async def run() -> ClusterStatus:
        client = HttpClient()
        try:

            async def read(ledger: Ledger | None) -> ClusterStatus:
                return await read_status(
                    config,
                    ledger,
                    lambda name, url, deadline: peek_capabilities(
                        client, name, url, token=token, deadline_ts=deadline
                    ),
                    config_path=args.config,
                )

            try:
                async with Ledger.open(config.ledger, readonly=True) as ledger:
                    return await read(ledger)
            except QuiesceError as error:  # the ledger cannot be read: the servers still can
                warnings.append(f"the ledger cannot be read ({error}); holders are not looked up")
                return await read(None)
        finally:
            await client.aclose()

    status = anyio.run(run)
    print_warnings(warnings)
    if args.json:
        emit_json(status.as_json())
    else:
        _print(status)
    return 0 if status.idle else 1


def _print(status: ClusterStatus) -> None:
    from rich.table import Table  # people-facing output only: --json never loads rich

    table = Table(show_edge=False, pad_edge=False)
    for column in ("server", "phase", "held by", "kind", "since", "deadline left"):
        table.add_column(column)
    for server in status.servers:
        if not server.reachable:
            table.add_row(
                escape(server.name), f"[red]unreachable[/]: {escape(server.error or '')}", "", "", "", ""
            )
            continue
        left = server.deadline_left_s
        table.add_row(
            escape(server.name),
            escape(server.phase or "") if not server.held else f"[yellow]{escape(server.phase or '')}[/]",
            escape(server.held_by or "-"),
            escape(server.holder_kind or ""),
            escape(server.since or ""),
            "" if left is None else (f"{left:.1f}s" if left >= 0 else f"passed {-left:.1f}s ago"),
        )
    console = output.console
    console.print(table)
    for holder in status.holders:
        console.print(
            f"{escape(holder.checkpoint_id)} ({escape(holder.kind)}: {escape(holder.state)}) — free with:"
            f" [bold]{escape(holder.frees)}[/]",
            soft_wrap=True,
        )
    if status.idle:
        console.print("every server is idle")
