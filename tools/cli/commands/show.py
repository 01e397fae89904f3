"""`quiesce show ID|latest --ledger URL|FILE | --config C [-o FORMAT]` — one attempt, from the ledger alone.

Prints every call in seq order (seq sent / seq of the outcome, phase, server, route, status or
error code, elapsed), the participant × phase matrix (intended, sent, acknowledged, failed,
unknown, compensated), the recovery evidence if any, a compact timeline, and the protocol check
of the attempt (`quiesce check ID`). Exit 0 when the attempt exists (whatever the check found —
`quiesce check` is the command whose exit code judges), 1 when the ledger has no such attempt.
`-o wide` adds each call's time, URL and reply detail; `--json` prints the attempt with its
`check`; `-o jsonl` one call per line.
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from quiesce.tools.audit.attempts import AttemptView
from quiesce.tools.audit.check import CheckReport, check_events
from quiesce.tools.audit.present import print_attempt, print_check
from quiesce.tools.audit.source import load_attempt, open_readonly
from quiesce.tools.cli.flags import add_ledger, add_output
from quiesce.tools.cli.output import console, emit_json, emit_jsonl


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "show",
        help="one attempt: every call in order, with timing and outcome",
        description="Explain one checkpoint attempt from the ledger: calls, participant × phase "
        "matrix, recovery evidence and a timeline.",
    )
    parser.add_argument(
        "checkpoint_id", metavar="ID", help="checkpoint id of the attempt (`latest`: the newest attempt)"
    )
    add_ledger(parser)
    add_output(parser)
    parser.set_defaults(handler=handle)


async def _load(url: str, checkpoint_id: str) -> tuple[AttemptView, CheckReport]:
    async with open_readonly(url) as ledger:
        view, events = await load_attempt(ledger, checkpoint_id)
    return view, check_events(events).for_attempt(view.checkpoint_id)


def handle(args: argparse.Namespace) -> int:
    view, report = anyio.run(_load, args.ledger, args.checkpoint_id)
    if args.output == "jsonl":
        emit_jsonl({"checkpoint_id": view.checkpoint_id, **call.to_json()} for call in view.calls)
    elif args.json:
        emit_json({**view.to_json(), "check": report.to_json()})
    else:
        print_attempt(console, view, wide=args.output == "wide")
        print_check(console, report)
    return 0
