"""`quiesce show ID|latest --ledger URL|FILE | --config C [-o FORMAT]` — one attempt, from the ledger alone.

Prints every call in seq order (seq sent / seq of the outcome, phase, server, route, status or
error code, elapsed), the participant × phase matrix (intended, sent, acknowledged, failed,
unknown, compensated), the recovery evidence if any, a compact timeline, and the protocol check
of the attempt (`quiesce check ID`). Exit 0 when the attempt exists (whatever the check found —
`quiesce check` is the command whose exit code judges), 1 when the ledger has no such attempt.
`-o wide` adds each call's time, URL and reply detail; `--json` prints the attempt with its
`check`; `-o jsonl` one call per line. Each says the control plane the attempt's servers speak
(`plane`: `v1`, or `v2` for Gym's unified plane), as its `attempt.started` recorded it.
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from quiesce.ledger import Event
from quiesce.tools.audit.attempts import AttemptView
from quiesce.tools.audit.check import CheckReport, check_events
from quiesce.tools.audit.present import print_attempt, print_check
from quiesce.tools.audit.source import load_attempt, open_readonly
from quiesce.tools.cli.flags import add_ledger, add_output
from quiesce.tools.cli.output import console, emit_json, emit_jsonl
from quiesce.tools.cli.safe_text import cleaned, markup

#: What each plane is, for people.
PLANES = {"v1": "Gym's control plane v1", "v2": "Gym's unified checkpoint plane"}


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


def plane_of(events: list[Event]) -> str:
    """The plane an attempt's `attempt.started` records (`v1` when it names none: v1's never do)."""
    for event in events:
        if event.kind == "attempt.started":
            plane = event.data.get("plane")
            return plane if isinstance(plane, str) else "v1"
    return "v1"


async def _load(url: str, checkpoint_id: str) -> tuple[AttemptView, CheckReport, str]:
    async with open_readonly(url) as ledger:
        view, events = await load_attempt(ledger, checkpoint_id)
    return view, check_events(events).for_attempt(view.checkpoint_id), plane_of(events)


def handle(args: argparse.Namespace) -> int:
    view, report, plane = anyio.run(_load, args.ledger, args.checkpoint_id)
    if args.output == "jsonl":
        emit_jsonl(
            {"checkpoint_id": view.checkpoint_id, "plane": plane, **call.to_json()} for call in view.calls
        )
    elif args.json:
        emit_json({**view.to_json(), "plane": plane, "check": report.to_json()})
    else:
        # the ledger holds servers' replies as they came: every text on one line, capped
        print_attempt(console, cleaned(view), wide=args.output == "wide")
        console.print(f"plane: {markup(plane)} ({PLANES.get(plane, 'unknown')})", highlight=False)
        print_check(console, cleaned(report))
    return 0
