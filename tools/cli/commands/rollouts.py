"""`quiesce rollouts --ledger URL|FILE | --config C [--rollout ID] [--state S] [-o FORMAT]`.

Each rollout's lineage, from the ledger alone (`quiesce.ledger.lineage`): every attempt, which
checkpoint captured it, which restore continued it as which attempt, what was restarted,
retired, forgotten or acknowledged — and its state now (`live`, `restarted`, `retired`,
`finished`, `lost`). Read-only: it opens the ledger without taking an epoch, so it never fences a
running coordinator; it reads only the lineage's event kinds — with `--rollout` (and no `--state`),
only the events of those rollouts' lineage (`quiesce.ledger.rollout_refs`), and `counts` counts
only the rollouts shown.

`--rollout ID` (repeatable) shows only those rollouts; `--state S` only those in state S. A table
by default — one row per rollout, its steps as a strip, `lost` in red; `-o wide` adds the seqs;
`--json` (`-o json`) prints `{"rollouts": [...], "counts": {state: n}, "violations": [...],
"warnings": [...]}`, each rollout `{"rollout_id", "attempt", "state", "steps": [{"seq", "what",
"attempt", "checkpoint_id", "servers", "detail"}]}`; `-o jsonl` one rollout per line. Exit 0
whatever the states (`quiesce check` judges them); 1 when `--rollout` names a rollout the ledger
never saw.
"""

from __future__ import annotations

import argparse
from typing import Any

from quiesce.ledger.lineage import STATES, LineageReport, Rollout
from quiesce.tools.audit.lineage import chosen, document, strip, unknown
from quiesce.tools.cli.flags import CommandError, add_ledger, add_output
from quiesce.tools.cli.output import emit_json, emit_jsonl


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "rollouts",
        help="each rollout's lineage across checkpoints and restores, and its state now",
        description="Show what became of every rollout attempt, from the ledger alone: captured,"
        " continued, restarted, retired, finished or lost.",
    )
    add_ledger(parser)
    add_output(parser)
    parser.add_argument(
        "--rollout", metavar="ID", action="append", help="only this rollout (repeat for several)"
    )
    parser.add_argument(
        "--state", metavar="S", choices=STATES, help=f"only rollouts in state S ({', '.join(STATES)})"
    )
    parser.set_defaults(handler=handle)


async def read(url: str, only: list[str] | None) -> LineageReport:
    """The lineage of the ledger at `url` (read-only): every rollout, or those `only` names alone
    (`quiesce.ledger.rollout_refs.read_lineage_of`: through the `rollout_refs` projection, in time
    that grows with their own history; `counts` then counts those)."""
    from quiesce.ledger.rollout_refs import read_lineage_of
    from quiesce.tools.audit.source import open_readonly

    async with open_readonly(url) as ledger:
        return await read_lineage_of(ledger, only)


def read_now(url: str, only: list[str] | None) -> LineageReport:
    """`read`'s answer. Named rollouts of a SQLite ledger at the head revision are read on this
    thread without an event loop (`quiesce.ledger.sqlite_reads.read_rollout_lineage_now`: the same
    queries and fold, a cold process's fastest path); anything else opens the `Ledger`."""
    if only:
        from quiesce.ledger.urls import plain_sqlite_path

        path = plain_sqlite_path(url)
        if path is not None:
            from quiesce.ledger import sqlitefile
            from quiesce.ledger.sqlite_reads import read_rollout_lineage_now

            found = read_rollout_lineage_now(sqlitefile.resolve(path), only)
            if found is not None:
                return found
    import anyio

    return anyio.run(read, url, only)


_STATE_STYLE = {
    "live": "green",
    "finished": "",
    "restarted": "yellow",
    "retired": "yellow",
    "lost": "bold red",
}


def handle(args: argparse.Namespace) -> int:
    report = read_now(args.ledger, args.rollout)
    rows = chosen(report, args.rollout, args.state)
    missing = unknown(report, args.rollout)
    if args.output == "jsonl":
        emit_jsonl([r.to_json() for r in rows])
    elif args.json:
        emit_json(document(report, rows, missing))
    else:
        _print_table(report, rows, wide=args.output == "wide")
    if missing:
        if not args.json and args.output != "jsonl":
            raise CommandError(
                f"the ledger {args.ledger} never recorded rollout {', '.join(missing)}: no save captured it,"
                " no restore continued it, nothing retired, forgot or acknowledged it",
                code="unknown_rollout",
            )
        return 1
    return 0


def _print_table(report: LineageReport, rows: list[Rollout], *, wide: bool) -> None:
    from rich.table import Table
    from rich.text import Text

    from quiesce.tools.audit.present import widened
    from quiesce.tools.cli.output import console  # rich: only for a table (never for --json)
    from quiesce.tools.cli.safe_text import one_line

    counts = ", ".join(f"{n} {state}" for state, n in report.counts().items() if n) or "none recorded"
    console.print(Text(f"rollouts: {counts}"))
    if not rows:
        return
    table = Table(box=None, pad_edge=False)
    table.add_column("rollout", no_wrap=True, overflow="fold")
    table.add_column("state")
    table.add_column("attempt", justify="right")
    table.add_column("lineage")
    for r in rows:
        style = _STATE_STYLE.get(r.state, "")
        table.add_row(
            Text(one_line(r.rollout_id)),
            Text(r.state, style=style),
            Text(str(r.attempt)),
            Text(one_line(strip(r.steps, seqs=wide), limit=10_000)),
        )
    widened(console).print(table)
    shown = {r.rollout_id for r in rows}
    for title, items, style in (
        ("violations", report.violations, "red"),
        ("warnings", report.warnings, "yellow"),
    ):
        mine = [v for v in items if v.rollout_id in shown]
        for v in mine:
            console.print(
                Text(f"{title[:-1]}: seq {v.seq} {v.rule}: {one_line(v.message, limit=2_000)}", style=style)
            )
