"""`quiesce check [ID|latest] --ledger URL|FILE | --config C [--expect FILE] [-o FORMAT]` — the
protocol check, and the rollout lineage.

From the events alone.

With an ID, checks that attempt (its events plus every `coordinator.started`, so stale epochs
are seen) and recomputes each of those events' hashes; without, checks every attempt of the
ledger and verifies the whole hash chain in the same pass. The output says which of the two was
verified. Either way the `attempts` projection (what `history` and `status` show) is compared
with a fold of the events, every differing column named. Rules and their meaning:
`tools/audit/check.py`. Exit 0 with no violation (warnings allowed), an intact chain and a
matching projection, 1 with any violation, a broken chain, a projection that differs, or when the
attempt does not exist. `-o jsonl` prints one line per violation and warning (`"severity"` says which).

Without an ID the rollout lineage is checked too (rules: `quiesce.ledger.lineage`, reported as
`lineage-<rule>` with the rollout they name), and `--expect FILE` — the trainer's own view, JSON
lines of `{"rollout_id": ..., "attempt": ...}` it holds live — reports every difference from the
lineage as a `lineage-expect` violation. `--expect` with an ID is bad usage (exit 2).
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from quiesce.tools.audit.check import CheckReport, check_events
from quiesce.tools.audit.cli import attempt_projection, check_ledger
from quiesce.tools.audit.present import print_check
from quiesce.tools.audit.source import checked_attempt_events, open_readonly, resolve_attempt_id
from quiesce.tools.cli.episodes import FILE_HELP, read_episodes
from quiesce.tools.cli.flags import UsageError, add_ledger, add_output
from quiesce.tools.cli.output import console, emit_json, emit_jsonl


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
    parser.add_argument(
        "--expect",
        metavar="FILE",
        help="the trainer's live rollout attempts, to compare with the ledger's lineage: " + FILE_HELP,
    )
    add_ledger(parser)
    add_output(parser)
    parser.set_defaults(handler=handle)


async def check_one(url: str, checkpoint_id: str) -> CheckReport:
    """`quiesce check ID`: one attempt's events and their context, each row's hash, its projection row."""
    async with open_readonly(url) as ledger:
        checkpoint_id = await resolve_attempt_id(ledger, checkpoint_id)
        live = await ledger.attempt(checkpoint_id, stored=True)  # before its events: see `attempt_projection`
        events, chain, rows = await checked_attempt_events(ledger, checkpoint_id)
    report = check_events(events).for_attempt(checkpoint_id)
    report.chain = chain
    report.projection = attempt_projection(checkpoint_id, live, rows)
    return report


def handle(args: argparse.Namespace) -> int:
    if args.expect is not None and args.checkpoint_id is not None:
        raise UsageError(
            "--expect compares the whole ledger's rollout lineage: leave out the attempt id", code="expect"
        )
    if args.checkpoint_id is None:
        expect = None
        if args.expect is not None:
            expect = [(e.rollout_id, e.attempt) for e in read_episodes(args.expect, flag="--expect")]
        report = anyio.run(check_ledger, args.ledger, expect)
    else:
        report = anyio.run(check_one, args.ledger, args.checkpoint_id)
    if args.output == "jsonl":
        emit_jsonl(
            [{**v.to_json(), "severity": "violation"} for v in report.violations]
            + [{**v.to_json(), "severity": "warning"} for v in report.warnings]
        )
    elif args.json:
        emit_json(report.to_json())
    else:
        print_check(console, report)
    return 0 if report.ok else 1
