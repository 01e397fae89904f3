"""`quiesce verify-bundle FILE [--json]` — check an audit bundle offline (no database).

Recomputes every event's hash and every link of the chain (see `tools/audit/bundle.py`). Exit 0
when the bundle is intact, 1 naming the seq of each event that is not, 2 when the file cannot
be read.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.text import Text

from tools.audit.bundle import verify_bundle
from tools.cli.output import console, emit_json, print_error


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "verify-bundle",
        help="verify an audit bundle offline (hash chain, no database)",
        description="Recompute the hash chain of a bundle written by `quiesce export`.",
    )
    parser.add_argument("bundle", metavar="FILE", type=Path, help="bundle file (JSON Lines)")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    try:
        result = verify_bundle(args.bundle)
    except (OSError, UnicodeDecodeError) as error:
        print_error(f"cannot read bundle {args.bundle}: {error}")
        return 2
    if args.json:
        emit_json(result.to_json())
        return 0 if result.ok else 1
    header = result.header
    scope = f"checkpoint {header.get('checkpoint')}" if header.get("checkpoint") else "whole ledger"
    runs = ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in result.runs) or "none"
    console.print(Text(f"bundle {args.bundle}: {scope}, {result.events} events (seq {runs})"))
    if result.ok:
        what = (
            "complete chain from genesis to the exported head"
            if result.complete
            else "every event and run link"
        )
        console.print(Text(f"ok: {what} verified", style="green"))
        return 0
    for problem in result.problems:
        console.print(Text(f"BAD {problem}", style="red"))
    return 1
