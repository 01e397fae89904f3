"""`quiesce verify-bundle FILE [--ledger URL|FILE | --config C] [--json]` — check an audit bundle offline.

Recomputes every event's hash and every link of the chain (see `tools/audit/bundle.py`), with no
database. With a ledger (`--ledger`, or `--config`'s), also compares every hash the bundle states
(events and run anchors) with that ledger's, and recomputes that ledger's rows in the bundle's
ranges from their content (an edited row whose hash columns were left alone is found too). Exit 0
when the bundle is intact, 1 naming the seq of each event
that is not, 2 when the file cannot be read.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import anyio
from rich.text import Text

from quiesce.coordinator.wording import count
from quiesce.ledger.urls import safe
from quiesce.tools.audit.bundle import verify_bundle
from quiesce.tools.audit.source import cross_check
from quiesce.tools.cli.flags import CommandError, add_ledger
from quiesce.tools.cli.output import console, emit_json


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "verify-bundle",
        help="verify an audit bundle offline (hash chain, no database)",
        description="Recompute the hash chain of a bundle written by `quiesce export`.",
    )
    parser.add_argument("bundle", metavar="FILE", type=Path, help="bundle file (JSON Lines)")
    # --ledger / --config: also compare every hash the bundle states (events, anchors) with that
    # ledger (read-only); never from $QUIESCE_CONFIG — a plain verify needs no database
    add_ledger(parser, required=False, use_env=False)
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    try:
        result = verify_bundle(args.bundle, keep_claims=args.ledger is not None)
    except (OSError, UnicodeDecodeError) as error:
        raise CommandError(f"cannot read bundle {args.bundle}: {error}", code="io", exit_code=2) from None
    if args.ledger is not None:
        anyio.run(cross_check, args.ledger, result)
    if args.json:
        emit_json(result.to_json())
        return 0 if result.ok else 1
    header = result.header
    scope = f"checkpoint {header.get('checkpoint')}" if header.get("checkpoint") else "whole ledger"
    runs = ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in result.runs) or "none"
    console.print(Text(f"bundle {args.bundle}: {scope}, {count(result.events, 'event')} (seq {runs})"))
    if result.ok:
        what = (
            "complete chain from genesis to the exported head"
            if result.complete
            else "every event and run link"
        )
        console.print(Text(f"ok: {what} verified", style="green"))
        if args.ledger is not None:
            console.print(
                Text(
                    f"ok: every stated hash ({len(result.claims)}) matches the ledger, whose rows there"
                    " recompute from their content",
                    style="green",
                )
            )
        return 0
    for problem in result.problems:
        console.print(Text(f"BAD {problem}", style="red"))
    for problem in result.ledger_problems:
        console.print(Text(f"BAD {problem} (ledger {safe(args.ledger)})", style="red"))
    return 1
