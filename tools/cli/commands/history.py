"""`quiesce history --ledger URL|FILE | --config C [--since T] [--outcome O] [--limit N] [--before ID]
[-o FORMAT]`.

One row per attempt, oldest first — the order `quiesce report` lists them in —, read from the
`attempts` projection, so it stays fast on large ledgers: id, kind, outcome, snapshot, started,
duration, participants, calls, failures, recovered-by. Only restores cost more: the events of
each restore attempt shown are read (one indexed query) for the snapshot it restored and whether
it was resumed since — the projection keeps a restore's first end, `restored`, while its outcome
is `resumed` once a resume finished it. The snapshot of a save is the one it published (its
checkpoint id). It must run in well under a second as a fresh process on a 1,000,000-event
ledger, so it imports only what it uses: rich only for a short table on a terminal-sized history,
never for `--json` or the plain text of a long one (`tests/audit/test_history.py` checks the
imports).

Read-only: opens the ledger without taking an epoch, so it never fences a running coordinator.
`--since` takes a UTC time (`2025-01-02`, `2025-01-02T03:04:05Z`) or an age (`90s`, `30m`, `2h`,
`7d`); `--outcome` one of published, restored, resumed, aborted, abandoned, or `open` (no terminal
event yet). Paging: `--limit N` shows the N most recent and reads only those rows; `--before ID`
shows only the attempts started before attempt ID, so `--limit N --before <the oldest id shown>`
is the next page back, as cheap as the first (a table says so under a full page). `--json`
(`-o json`) prints a list of `{"checkpoint_id", "kind", "state", "outcome",
"snapshot", "started_at", "ended_at", "duration_s", "participants", "epoch", "calls", "failures",
"recovered_by"}`; `-o jsonl` one such object per line; `-o wide` adds the state, end and epoch
columns. The checkpoint and snapshot ids are never cut: the other columns wrap. As a table (no
`--outcome`), the retires and forgets recorded outside any attempt (Gym's unified plane) follow,
as operations (`quiesce.tools.audit.operations`); a ledger without any prints nothing more.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import anyio

from quiesce.ledger import AttemptRow, Ledger
from quiesce.tools.audit.source import open_readonly
from quiesce.tools.audit.timefmt import duration, short_at
from quiesce.tools.cli.flags import UsageError, add_ledger, add_output

OUTCOMES: Final = ("published", "restored", "resumed", "aborted", "abandoned", "open")
#: Outcomes the projection cannot filter on: a restore's row says `restored` even once resumed.
_RESTORE_OUTCOMES: Final = ("restored", "resumed")
_AGE: Final = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """A UTC datetime from an ISO time/date (naive means UTC) or an age such as `2h` before `now`."""
    age = _AGE.match(text.strip())
    if age:
        seconds = float(age.group(1)) * _UNIT_S[age.group(2)]
        return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--since {text!r}: give a UTC time like 2025-01-02 or 2025-01-02T03:04:05Z, or an age like 2h"
        ) from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def _not_negative(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (0: all)")
    return int(text)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "history",
        help="one line per attempt",
        description="List every checkpoint and restore attempt recorded in the ledger, oldest first.",
    )
    add_ledger(parser)
    add_output(parser)
    parser.add_argument("--since", metavar="T", type=parse_since, help="attempts started at or after T")
    parser.add_argument("--outcome", metavar="O", choices=OUTCOMES, help="only this outcome (or `open`)")
    parser.add_argument(
        "--limit", metavar="N", type=_not_negative, default=0, help="only the N most recent (0: all)"
    )
    parser.add_argument(
        "--before",
        metavar="ID",
        help="only attempts started before attempt ID (the next page back: the oldest id a page shows)",
    )
    parser.set_defaults(handler=handle)


class UnknownAttempt(Exception):
    """`--before` names an attempt the ledger does not hold."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One attempt as history shows it: its projection row, its outcome now (a restore resumed
    since is `resumed`) and its snapshot (a published save's own, or the one a restore restored)."""

    row: AttemptRow
    outcome: str | None
    snapshot: str | None


async def entry(ledger: Ledger, row: AttemptRow) -> Entry:
    """The `Entry` of `row`: from the row alone for a save; a restore's events are read."""
    if row.kind != "restore":
        return Entry(row, row.outcome, row.checkpoint_id if row.outcome == "published" else None)
    outcome, source = row.outcome, None
    async for event in ledger.read(checkpoint_id=row.checkpoint_id):
        if event.kind == "attempt.started" and isinstance(event.data.get("source_checkpoint_id"), str):
            source = event.data["source_checkpoint_id"]
        elif event.kind == "attempt.completed" and event.data.get("outcome") == "resumed":
            outcome = "resumed"
    return Entry(row, outcome, source)


#: Restores read per page when `--outcome restored|resumed --limit N` pages back from the newest.
RESTORE_PAGE: Final = 256


async def read_entries(
    url: str, since: datetime | None, outcome: str | None, limit: int = 0, before_id: str | None = None
) -> list[Entry]:
    """The attempts to show, oldest first: `outcome` (`open`: no terminal event yet), only those
    started before attempt `before_id` (in start order; `UnknownAttempt` if the ledger has no
    such attempt), and the `limit` most recent (0: all) applied.

    With `limit`, the database reads that many rows from the end of its start-order index (from
    `before_id` back), not the whole history. A restore's outcome now (`restored`, or `resumed`
    since) is read from its events, so those two page back from the newest restores until `limit`
    of them match."""
    async with open_readonly(url) as ledger:
        before = None if before_id is None else await ledger.start_key(before_id)
        if before_id is not None and before is None:
            raise UnknownAttempt(before_id)
        if outcome not in _RESTORE_OUTCOMES:
            rows = await ledger.attempts(since=since, outcome=outcome, limit=limit, before=before)
            return [await entry(ledger, row) for row in rows]
        found: list[Entry] = []
        while True:
            rows = await ledger.attempts(
                since=since, outcome=_RESTORE_OUTCOMES, limit=RESTORE_PAGE if limit else 0, before=before
            )
            found = [e for e in [await entry(ledger, row) for row in rows] if e.outcome == outcome] + found
            if not limit or len(found) >= limit or len(rows) < RESTORE_PAGE:
                return found[-limit:] if limit else found
            before = (rows[0].started_at, rows[0].checkpoint_id)


def duration_s(row: AttemptRow) -> float | None:
    if row.ended_at is None:
        return None
    try:
        return max(
            0.0,
            (datetime.fromisoformat(row.ended_at) - datetime.fromisoformat(row.started_at)).total_seconds(),
        )
    except ValueError:
        return None


def to_json(item: Entry) -> dict[str, Any]:
    row = item.row
    return {
        "checkpoint_id": row.checkpoint_id,
        "kind": row.kind,
        "state": row.state,
        "outcome": item.outcome,
        "snapshot": item.snapshot,
        "started_at": row.started_at,
        "ended_at": row.ended_at,
        "duration_s": duration_s(row),
        "participants": list(row.participants),
        "epoch": row.epoch,
        "calls": row.calls,
        "failures": row.failures,
        "recovered_by": row.recovered_by,
    }


def emit_rows(rows: list[Entry], *, lines: bool = False) -> None:
    """One JSON array on stdout, one compact row per line (`lines`: the rows alone, JSON Lines):
    the C encoder keeps this fast on tens of thousands of attempts (an indented dump goes through
    the pure-Python encoder)."""
    from quiesce.tools.cli.safe_text import json_text

    encode = json.JSONEncoder(sort_keys=True, ensure_ascii=False).encode
    if lines:
        sys.stdout.write(json_text("".join(encode(to_json(row)) + "\n" for row in rows)))
    else:
        body = json_text(",\n".join(encode(to_json(row)) for row in rows))
        sys.stdout.write(f"[\n{body}\n]\n" if rows else "[]\n")
    sys.stdout.flush()


COLUMNS: Final = (
    "checkpoint",
    "kind",
    "outcome",
    "snapshot",
    "started (UTC)",
    "duration",
    "participants",
    "calls",
    "failures",
    "recovered by",
)
#: What `-o wide` adds.
WIDE_COLUMNS: Final = ("state", "ended (UTC)", "epoch")
#: Columns holding ids: never cut; the free ones wrap first (`present.add_columns`).
_WHOLE: Final = frozenset({"checkpoint", "snapshot"})
_FREE: Final = frozenset({"started (UTC)", "participants", "recovered by", "ended (UTC)"})
_RIGHT: Final = frozenset({"calls", "failures", "duration", "epoch"})
#: Above this many rows the table is written as plain aligned text: rich measures every cell and
#: takes seconds on tens of thousands of rows.
RICH_MAX_ROWS: Final = 500


def cells(item: Entry, *, wide: bool = False) -> list[str]:
    """One row's cells, each on one line and capped (`safe_text.one_line`)."""
    from quiesce.tools.cli.safe_text import one_line

    return [one_line(cell) for cell in _cells(item, wide=wide)]


def _cells(item: Entry, *, wide: bool = False) -> list[str]:
    row = item.row
    extra = [row.state, short_at(row.ended_at) if row.ended_at else "-", str(row.epoch)] if wide else []
    return [
        row.checkpoint_id,
        row.kind,
        item.outcome or f"open ({row.state})",
        item.snapshot or "-",
        short_at(row.started_at),
        duration(duration_s(row)) if row.ended_at else "-",
        ", ".join(row.participants),
        str(row.calls),
        str(row.failures),
        f"epoch {row.recovered_by}" if row.recovered_by is not None else "-",
        *extra,
    ]


def columns(wide: bool) -> tuple[str, ...]:
    return COLUMNS + WIDE_COLUMNS if wide else COLUMNS


def print_rich(rows: list[Entry], *, wide: bool = False) -> None:
    from rich.table import Table
    from rich.text import Text

    from quiesce.tools.audit.present import RESULT_STYLE, ColumnSpec, add_columns, widened
    from quiesce.tools.cli.output import console

    names = columns(wide)
    grid = [cells(item, wide=wide) for item in rows]
    table = Table(box=None, pad_edge=False)
    out = widened(console)
    specs = [
        ColumnSpec(
            name,
            [line[i] for line in grid],
            "whole" if name in _WHOLE else "free" if name in _FREE else "compact",
            "right" if name in _RIGHT else "left",
        )
        for i, name in enumerate(names)
    ]
    add_columns(table, specs, out.width)
    for item, values in zip(rows, grid, strict=True):
        styles = ["" for _ in values]
        styles[2] = RESULT_STYLE.get(item.outcome or "", "yellow")
        styles[names.index("failures")] = "red" if item.row.failures else ""
        table.add_row(*(Text(v, style=st) for v, st in zip(values, styles, strict=True)))
    out.print(table)


def print_plain(rows: list[Entry], *, wide: bool = False) -> None:
    """The same table as aligned plain text (no colour), for very long histories."""
    names = columns(wide)
    grid = [list(names), *(cells(row, wide=wide) for row in rows)]
    widths = [max(len(line[i]) for line in grid) for i in range(len(names))]
    out = sys.stdout
    try:
        for line in grid:
            parts = [
                value.rjust(width) if name in _RIGHT else value.ljust(width)
                for name, value, width in zip(names, line, widths, strict=True)
            ]
            out.write("  ".join(parts).rstrip() + "\n")
        out.flush()
    except BrokenPipeError:  # `quiesce history | head`: the reader has had enough
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())


def print_operations(args: argparse.Namespace) -> None:
    """The operations outside attempts (retire, forget), when any and no `--outcome` is asked."""
    if args.outcome is not None:
        return
    from quiesce.tools.audit.source import read_operations

    since = args.since.strftime("%Y-%m-%dT%H:%M:%S.%fZ") if args.since is not None else None
    operations = anyio.run(read_operations, args.ledger, since)
    if operations:
        from quiesce.tools.audit.present import operations_table, widened
        from quiesce.tools.cli.output import console

        widened(console).print(operations_table(operations))


def handle(args: argparse.Namespace) -> int:
    try:
        rows = anyio.run(read_entries, args.ledger, args.since, args.outcome, args.limit, args.before)
    except UnknownAttempt as unknown:
        from quiesce.tools.cli.safe_text import one_line

        raise UsageError(
            f"--before {one_line(str(unknown))}: no attempt with that id in the ledger; give a checkpoint id"
            " that `quiesce history` lists"
        ) from None
    if args.output in ("json", "jsonl"):
        emit_rows(rows, lines=args.output == "jsonl")
        return 0
    if not rows:
        from quiesce.tools.cli.output import console

        console.print(
            "no attempts recorded" if args.since is None and args.outcome is None else "no attempts match"
        )
    else:
        wide = args.output == "wide"
        if len(rows) > RICH_MAX_ROWS:
            print_plain(rows, wide=wide)
        else:
            print_rich(rows, wide=wide)
        if args.limit and len(rows) == args.limit:
            from quiesce.tools.cli.output import console
            from quiesce.tools.cli.safe_text import one_line

            console.print(
                f"older attempts: add --before {one_line(rows[0].row.checkpoint_id)}"
                " for the page before these",
                markup=False,
                highlight=False,
            )
    print_operations(args)
    return 0
