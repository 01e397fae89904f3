"""`quiesce discover --config C | --service URL [-o FORMAT]` — participants, skipped and refused
servers, with reasons.

Exit 0 when the cluster can take part, 2 when discovery refuses it (every reason is listed).
Needs no control token (capabilities are public): without one the coordinator is opened read-only
(no Authorization header, no recovery); the token is sent when it is set. A token that cannot be
a bearer token is a config error (exit 2), as for every command. `--service URL` asks a running
`quiesce serve` (which holds the ledger) instead; a refused setup is then its error, listing every
refusal.

A server without v1's capabilities route is asked for Gym's unified-plane checkpoint status
instead (that needs the control token); a cluster speaks one plane.

Output: a table of the participants with the control plane each speaks (`v1`, or `v2`: Gym's
unified plane, whose `component` is the server's kind), then the skipped and refused servers with
their reasons (`-o wide`: each participant's URL and features too). `--json`: `{"participants":
[{"name", "component", "checkpoint_mode", "instance_role", "plane"}], "skipped": [{"name",
"reason"}], "refused": [...], "warnings"}`; `-o jsonl`: one object per server, `{"name", "status":
"participant" | "skipped" | "refused", ...}` (a participant with its `plane`).
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from quiesce.coordinator import Coordinator, Discovery
from quiesce.tools.cli.cluster_cmd import add_common, config_of, driving, escape, print_warnings
from quiesce.tools.cli.flags import add_output
from quiesce.tools.cli.output import console, emit_json, emit_jsonl


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "discover",
        help="list participants, skipped and refused servers",
        description="Ask every configured server for its capabilities and apply the participation rules.",
    )
    add_common(parser, service=True)
    add_output(parser)
    parser.set_defaults(handler=handle)


def rows(found: Discovery) -> list[dict[str, Any]]:
    """One object per server (`-o jsonl`): participants first, then skipped, then refused."""
    listed: list[dict[str, Any]] = [
        {
            "name": m.name,
            "status": "participant",
            "component": m.component,
            "checkpoint_mode": m.checkpoint_mode,
            "instance_role": m.instance_role,
            "role": m.role,
            "url": m.url,
            "features": list(m.features),
            "plane": m.plane,
        }
        for m in found.participants
    ]
    for status, pairs in (("skipped", found.skipped), ("refused", found.refused)):
        listed += [{"name": name, "status": status, "reason": reason} for name, reason in pairs]
    return listed


def _print(found: Discovery, *, wide: bool) -> None:
    from rich.table import Table

    from quiesce.tools.audit.present import ColumnSpec, add_columns, widened
    from quiesce.tools.cli.safe_text import cleaned, markup

    found = cleaned(found)  # what the servers said of themselves: on one line, capped
    out = widened(console)
    members = found.participants
    table = Table(title="participants", title_justify="left")
    specs = [
        ColumnSpec("name", [m.name for m in members], "whole"),
        ColumnSpec("plane", [m.plane for m in members], "compact"),
        ColumnSpec("component", [m.component for m in members], "compact"),
        ColumnSpec("checkpoint_mode", [m.checkpoint_mode for m in members], "compact"),
        ColumnSpec("instance_role", [m.instance_role or "-" for m in members], "compact"),
        ColumnSpec("role", [m.role for m in members], "compact"),
    ]
    if wide:
        specs += [
            ColumnSpec("url", [m.url for m in members], "whole"),
            ColumnSpec("features", [", ".join(m.features) or "-" for m in members], "free"),
        ]
    add_columns(table, specs, out.width)
    for row in zip(*(spec.values for spec in specs), strict=True):
        table.add_row(*(markup(value) for value in row))
    out.print(table)
    for title, pairs in (("skipped", found.skipped), ("refused", found.refused)):
        if pairs:
            console.print(f"[bold]{title}[/]")
            for name, reason in pairs:
                console.print(f"  {escape(name)}: {escape(reason)}", soft_wrap=True)


def handle(args: argparse.Namespace) -> int:
    config = config_of(args)

    async def run() -> Discovery:
        async with driving(args, config, require_token=False) as coord:
            if isinstance(coord, Coordinator):
                return await coord.discover(strict=False)
            return await coord.discover()  # a service raises DiscoveryError for a refused setup

    found = anyio.run(run)
    if args.output == "jsonl":
        emit_jsonl(rows(found))
    elif args.json:
        emit_json(found.as_json())
    else:
        _print(found, wide=args.output == "wide")
    print_warnings(found.warnings)
    return 2 if found.refused else 0
