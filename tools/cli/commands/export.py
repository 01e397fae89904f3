"""`quiesce export --ledger URL|FILE | --config C [--checkpoint ID|latest] --out F.jsonl [--json]`.

An audit bundle.

Writes the ledger's events with their hash chain (all of them, or one attempt's with the hash
before each run) as JSON Lines that `quiesce verify-bundle` checks offline, with no database.
The format is documented in `tools/audit/bundle.py`. Exit 0 when written, 1 when the ledger or
the attempt cannot be read.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import anyio
from rich.text import Text

from quiesce.coordinator.wording import count
from quiesce.tools.audit.source import export_bundle
from quiesce.tools.cli.flags import add_ledger, out_file
from quiesce.tools.cli.output import console, emit_json


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "export",
        help="write an offline-verifiable audit bundle of the ledger (or one attempt)",
        description="Export events with their hash chain as JSON Lines (see `quiesce verify-bundle`).",
    )
    add_ledger(parser)
    parser.add_argument(
        "--checkpoint", metavar="ID", help="only this attempt (and its context); `latest`: the newest"
    )
    parser.add_argument("--out", metavar="FILE", required=True, type=Path, help="bundle file to write")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    out_file(args.out)  # exit 2 before the ledger is read
    summary = anyio.run(export_bundle, args.ledger, args.out, args.checkpoint)
    if args.json:
        emit_json({"out": str(args.out), "checkpoint": summary.checkpoint, **summary.to_json()})
    else:
        runs = ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in summary.runs) or "none"
        console.print(Text(f"wrote {args.out}: {count(summary.events, 'event')} (seq {runs})"))
    return 0
