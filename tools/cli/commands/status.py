"""`quiesce status --config C | --service URL [-o FORMAT]` — live: what holds each Gym server, and what
frees it.

Reads every configured server's capabilities now (its fence: phase, active checkpoint id, deadline)
— or, for a server of Gym's unified plane (no capabilities route: 404), its checkpoint status
(phase, checkpoint id, lease expiry, blocker count; that route needs the control token) — and
looks each holding id up in the ledger: its kind (save, restore, or `unknown` when this ledger
has no such attempt — another ledger's), since when (the first request of it the server received),
and the exact command that frees the server (`coordinator/status.py` has the rules). Read-only: the
ledger is opened read-only and no epoch is taken, so a coordinator at work is never disturbed;
nothing is recorded. The control token is sent when it is set (capabilities need none, so a v1
report is the same without it; a unified-plane server cannot be read without it); a token that
cannot be a bearer token is a config error (exit 2).

Exit 0 when every server is reachable and idle, 1 when any is held or cannot be read, 2 on bad
usage or config. `--json`: `{"idle", "held", "servers": [{"name", "url", "reachable", "phase",
"active_checkpoint_id", "held", "held_by", "holder_kind", "since", "deadline_left_s", "frees",
"error", "plane", and on the unified plane "kind", "lease_expires_at", "blocker_count"}],
"holders": [{"checkpoint_id", "kind", "state", "started_at", "finished", "frees"}],
"unfinished": [ID...]}`: `finished` false for an attempt `quiesce recover` would finish. `-o jsonl`:
one server object per line. The table shows each server's plane; on the unified plane the lease's
time left and the blocker count too. `-o wide` adds each server's URL and the command that frees it.
`--service URL` asks a running `quiesce serve` for the same report.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio

from quiesce.coordinator import QuiesceError, load_config
from quiesce.coordinator.calls import peek_capabilities, peek_v2_status
from quiesce.coordinator.config import find_token
from quiesce.coordinator.http import HttpClient
from quiesce.coordinator.status import ClusterStatus, read_status
from quiesce.ledger import Ledger
from quiesce.tools.cli import output
from quiesce.tools.cli.cluster_cmd import add_common, driving, escape, print_warnings
from quiesce.tools.cli.flags import add_output
from quiesce.tools.cli.output import emit_json, emit_jsonl


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "status",
        help="live: each server's fence, what holds it and the command that frees it",
        description="Read every server's fence now; name what holds each one, since when, and what frees it.",
    )
    add_common(parser, service=True)
    add_output(parser)
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    status = anyio.run(_remote, args) if args.service else _local(args)
    if args.output == "jsonl":
        emit_jsonl(server.as_json() for server in status.servers)
    elif args.json:
        emit_json(status.as_json())
    else:
        _print(status, wide=args.output == "wide")
    return 0 if status.idle else 1


async def _remote(args: argparse.Namespace) -> ClusterStatus:
    async with driving(args, None) as service:
        return await service.status()


def _local(args: argparse.Namespace) -> ClusterStatus:
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
                    peek_v2=lambda name, url, deadline: peek_v2_status(
                        client, name, url, token=token, deadline_ts=deadline
                    ),
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
    return status


def time_left(seconds: float | None) -> str:
    """`12.3s`, `passed 1.0s ago`, or empty for None."""
    if seconds is None:
        return ""
    return f"{seconds:.1f}s" if seconds >= 0 else f"passed {-seconds:.1f}s ago"


def lease_left(expires_at: float | None, now: float) -> str:
    """A unified-plane lease as time left (`-` when the server holds none)."""
    return "-" if expires_at is None else time_left(expires_at - now)


def _print(status: ClusterStatus, *, wide: bool = False) -> None:
    from rich.table import Table  # people-facing output only: --json never loads rich

    from quiesce.tools.audit.present import ColumnSpec, add_columns, widened
    from quiesce.tools.cli.safe_text import cleaned, markup

    status = cleaned(status)  # servers' replies: every field on one line, capped
    servers = status.servers
    now = time.time()
    phases = [(s.phase or "") if s.reachable else f"unreachable: {s.error or ''}" for s in servers]
    specs = [
        ColumnSpec("server", [s.name for s in servers], "whole"),
        ColumnSpec("plane", [s.plane for s in servers], "compact"),
        ColumnSpec("phase", phases, "free"),
        ColumnSpec("held by", [(s.held_by or "-") if s.reachable else "" for s in servers], "whole"),
        ColumnSpec("kind", [(s.holder_kind or "") if s.reachable else "" for s in servers], "compact"),
        ColumnSpec("since", [(s.since or "") if s.reachable else "" for s in servers], "free"),
    ]
    if any(s.plane == "v1" for s in servers):  # v1's fence deadline (the unified plane has leases)
        specs.append(
            ColumnSpec(
                "deadline left",
                [time_left(s.deadline_left_s) if s.reachable else "" for s in servers],
                "free",
            )
        )
    if any(s.plane == "v2" for s in servers):  # the unified plane's lease and prepare blockers
        specs += [
            ColumnSpec(
                "lease left",
                [lease_left(s.lease_expires_at, now) if s.plane == "v2" else "" for s in servers],
                "free",
            ),
            ColumnSpec(
                "blockers",
                [str(s.blocker_count) if s.blocker_count is not None else "" for s in servers],
                "compact",
            ),
        ]
    if wide:
        specs += [
            ColumnSpec("url", [s.url for s in servers], "whole"),
            ColumnSpec("frees", [s.frees or "" for s in servers], "free"),
        ]
    console = output.console
    out = widened(console)
    table = Table(show_edge=False, pad_edge=False)
    add_columns(table, specs, out.width)
    for server, row in zip(servers, zip(*(spec.values for spec in specs), strict=True), strict=True):
        cells = [markup(value) for value in row]
        if not server.reachable:
            cells[2] = f"[red]{cells[2]}[/]"
        elif server.held:
            cells[2] = f"[yellow]{cells[2]}[/]"
        table.add_row(*cells)
    out.print(table)
    for holder in status.holders:
        console.print(
            f"{escape(holder.checkpoint_id)} ({escape(holder.kind)}: {escape(holder.state)}) — free with:"
            f" [bold]{escape(holder.frees)}[/]",
            soft_wrap=True,
        )
    if status.idle:
        console.print("every server is idle")
