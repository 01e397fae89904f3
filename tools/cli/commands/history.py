"""`quiesce history --ledger URL | --config C [--json]` — one line per attempt, from the projection.

Read-only: opens the ledger without taking an epoch, so it never fences a running coordinator.
`--json` prints a list of `{"checkpoint_id", "kind", "state", "outcome", "started_at", "ended_at",
"participants", "epoch", "calls", "failures", "recovered_by"}`, oldest first.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

import anyio
from rich.markup import escape
from rich.table import Table

from coordinator import load_config, read_history
from tools.cli.output import console, emit_json


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "history",
        help="one line per attempt",
        description="List every checkpoint and restore attempt recorded in the ledger, oldest first.",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--ledger", metavar="URL", help="ledger database URL")
    where.add_argument("--config", metavar="FILE", help="cluster config (its ledger is read)")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    url = args.ledger if args.ledger else load_config(args.config).ledger
    rows = anyio.run(read_history, url)
    if args.json:
        documents = []
        for row in rows:
            item = asdict(row)
            item["participants"] = list(row.participants)
            item.pop("last_seq", None)
            item.pop("deadline_ts", None)
            documents.append(item)
        emit_json(documents)
        return 0
    if not rows:
        console.print("no attempts recorded")
        return 0
    table = Table(box=None, pad_edge=False)
    for column in ("checkpoint", "kind", "outcome", "started", "ended", "calls", "failed", "participants"):
        table.add_column(column, no_wrap=column != "participants")
    for row in rows:
        outcome = row.outcome or f"({row.state})"
        if row.recovered_by is not None:
            outcome += f" [recovered e{row.recovered_by}]"
        table.add_row(
            row.checkpoint_id,
            row.kind,
            escape(outcome),
            row.started_at.replace("T", " ")[:19],
            (row.ended_at or "-").replace("T", " ")[:19],
            str(row.calls),
            str(row.failures),
            escape(", ".join(row.participants)),
        )
    console.print(table)
    return 0
