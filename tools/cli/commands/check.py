"""`quiesce check [ID|latest] --ledger URL|FILE | --config C [--json]` — the protocol check.

From the events alone.

With an ID, checks that attempt (its events plus every `coordinator.started`, so stale epochs
are seen); without, checks every attempt of the ledger (as `quiesce replay --verify` does).
Rules and their meaning: `tools/audit/check.py`. Exit 0 with no violation (warnings allowed),
1 with any violation or when the attempt does not exist.
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from tools.audit.check import CheckReport, check_events
from tools.audit.cli import check_ledger
from tools.audit.present import print_check
from tools.audit.source import attempt_events, open_readonly, resolve_attempt_id
from tools.cli.flags import add_ledger
from tools.cli.output import console, emit_json


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "check",
        help="verify attempts obeyed the protocol (order, settled servers, deadline, epochs)",
        description="Check from the ledger alone that attempts obeyed the protocol; each violation "
        "is reported with the seq of the event that shows it.",
    )
    parser.add_argument(
        "checkpoint_id", metavar="ID", nargs="?", help="one attempt (`latest`: the newest; default: all)"
    )
    add_ledger(parser)
    parser.set_defaults(handler=handle)


async def _check_one(url: str, checkpoint_id: str) -> CheckReport:
    async with open_readonly(url) as ledger:
        checkpoint_id = await resolve_attempt_id(ledger, checkpoint_id)
        events = await attempt_events(ledger, checkpoint_id)
    return check_events(events).for_attempt(checkpoint_id)


def handle(args: argparse.Namespace) -> int:
    if args.checkpoint_id is None:
        report = anyio.run(check_ledger, args.ledger)
    else:
        report = anyio.run(_check_one, args.ledger, args.checkpoint_id)
    if args.json:
        emit_json(report.to_json())
    else:
        print_check(console, report)
    return 0 if report.ok else 1
