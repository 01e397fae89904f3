"""`quiesce replay --ledger URL|FILE | --config C [--verify] [--rebuild] [-o FORMAT]` — audit a ledger.

Always recomputes the hash chain and rebuilds the projections in memory, comparing them with
the live tables. Exit codes:

- plain: 1 when the chain is broken, else 0 (projection differences are reported);
- ``--verify``: 1 when the chain is broken, any projection differs, or the protocol check
  (``tools/audit/check.py``) finds a violation;
- ``--rebuild``: replaces the live projections with the rebuilt ones (needs the writer lock;
  refused, exit 1, when the chain is broken), then 0.

`-o jsonl` prints one line per projection difference (`{"checkpoint_id", "column", "live",
"rebuilt"}`); every difference is listed there, the table shows the first 50.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

import anyio
from rich.table import Table

from quiesce.coordinator.wording import count
from quiesce.ledger import ReplayReport, replay_url
from quiesce.ledger.urls import safe
from quiesce.tools.audit.cli import check_ledger
from quiesce.tools.audit.present import print_check
from quiesce.tools.cli.flags import add_ledger, add_output
from quiesce.tools.cli.output import console, emit_json, emit_jsonl
from quiesce.tools.cli.safe_text import escape

MAX_SHOWN = 50


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "replay",
        help="verify the hash chain and rebuild projections from events",
        description=(
            "Stream every event, recompute the SHA-256 chain (naming the first bad seq) and rebuild the "
            "attempts projection, comparing it with the live table."
        ),
    )
    add_ledger(parser)
    add_output(parser)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--verify",
        action="store_true",
        help="exit 1 on any problem: chain, projections, and the protocol check (see `quiesce check`)",
    )
    mode.add_argument(
        "--rebuild",
        action="store_true",
        help="replace the live projections with the rebuilt ones (takes the writer lock)",
    )
    parser.set_defaults(handler=handle)


def _print(report: ReplayReport, where: str) -> None:
    console.print(f"ledger {escape(where)}: {count(report.events, 'event')}, head seq {report.head_seq}")
    if report.head_hash:
        console.print(f"head hash {report.head_hash}")
    if report.chain_ok:
        console.print("chain: [green]ok[/]")
    else:
        console.print(
            f"chain: [bold red]BROKEN[/] at seq {report.first_bad_seq}: {escape(report.problem or '')}"
        )
    if report.projections_ok:
        console.print("projections: [green]match the events[/]")
    else:
        from quiesce.tools.audit.present import whole_column

        shown = report.differences[:MAX_SHOWN]
        table = Table(title="projection differences")
        whole_column(table, "checkpoint id", [diff.checkpoint_id for diff in shown])
        for name in ("column", "live", "rebuilt"):
            table.add_column(name, overflow="fold")
        for diff in report.differences[:MAX_SHOWN]:
            table.add_row(
                escape(diff.checkpoint_id), diff.column, escape(repr(diff.live)), escape(repr(diff.rebuilt))
            )
        console.print(table)
        more = len(report.differences) - MAX_SHOWN
        if more > 0:
            console.print(f"... and {count(more, 'more difference')} (-o jsonl lists every one)")
    if report.rebuilt:
        console.print("projections [green]rebuilt[/] from the events")


def handle(args: argparse.Namespace) -> int:
    report = anyio.run(lambda: replay_url(args.ledger, rebuild=args.rebuild))
    # --verify adds the protocol check (tools/audit/check.py) once the chain is known good.
    protocol = anyio.run(check_ledger, args.ledger) if args.verify and report.chain_ok else None
    if args.output == "jsonl":
        emit_jsonl(asdict(diff) for diff in report.differences)
    elif args.json:
        emit_json({**report.to_json(), **({"protocol": protocol.to_json()} if protocol else {})})
    else:
        _print(report, safe(args.ledger))
        if protocol is not None:
            print_check(console, protocol)
    if not report.chain_ok:
        return 1
    if args.verify and not (report.projections_ok and protocol is not None and protocol.ok):
        return 1
    return 0
