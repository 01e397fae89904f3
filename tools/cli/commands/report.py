"""`quiesce report --ledger URL|FILE | --config C --out F.html [--checkpoint ID|latest] [--limit N] [--json]`.

Writes one self-contained HTML page (no network, no external scripts or fonts): a summary table of
the most recent attempts and, per attempt, a Gantt timeline — one lane per server, one bar per
call coloured by outcome, phase bands, the deadline, recovery actions; per published save its
rollout figures, and the ledger's rollout lineage (states, violations, each rollout's steps:
the first 200 and every lost one). See `tools/audit/report.py`.
Exit 0 when written, 1 when the ledger (or the attempt) cannot be read.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import anyio
from rich.text import Text

from quiesce.coordinator.wording import count
from quiesce.ledger.urls import safe
from quiesce.tools.audit.attempts import AttemptView
from quiesce.tools.audit.lineage import ReportLineage, report_lineage
from quiesce.tools.audit.report import render_report
from quiesce.tools.audit.source import load_views, open_readonly
from quiesce.tools.cli.flags import add_ledger, out_file
from quiesce.tools.cli.output import console, emit_json


def _at_least_one(text: str) -> int:
    value = int(text) if text.strip().lstrip("-").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "report",
        help="write a self-contained HTML timeline page of the attempts",
        description="Render attempts as a self-contained HTML page: summary table and Gantt timelines.",
    )
    add_ledger(parser)
    parser.add_argument("--out", metavar="FILE.html", required=True, type=Path, help="page to write")
    parser.add_argument("--checkpoint", metavar="ID", help="only this attempt (`latest`: the newest)")
    parser.add_argument(
        "--limit", metavar="N", type=_at_least_one, default=20, help="the N most recent attempts (default 20)"
    )
    parser.set_defaults(handler=handle)


async def _load(url: str, checkpoint_id: str | None, limit: int) -> tuple[list[AttemptView], ReportLineage]:
    """The attempts the page shows, then the ledger's rollout lineage."""
    views = await load_views(url, checkpoint_id, limit)
    async with open_readonly(url) as ledger:
        return views, await report_lineage(ledger)


def handle(args: argparse.Namespace) -> int:
    out_file(args.out)  # exit 2 before the ledger is read
    views, lineage = anyio.run(_load, args.ledger, args.checkpoint, args.limit)
    page = render_report(views, source=safe(args.ledger), lineage=lineage)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, args.out)
    finally:
        tmp.unlink(missing_ok=True)
    calls = sum(len(v.calls) for v in views)
    if args.json:
        emit_json({"out": str(args.out), "attempts": [v.checkpoint_id for v in views], "calls": calls})
    else:
        console.print(Text(f"wrote {args.out}: {count(len(views), 'attempt')}, {count(calls, 'call')}"))
    return 0
