"""`quiesce history --ledger URL | --config C [--since T] [--outcome O] [--limit N] [--json]`.

One row per attempt, oldest first, read from the `attempts` projection only (never the events),
so it stays fast on large ledgers: id, kind, outcome, started, duration, participants, calls,
failures, recovered-by. It must run in well under a second as a fresh process on a
1,000,000-event ledger, so it imports only what it uses: rich only for a short table on a
terminal-sized history, never for `--json` or the plain text of a long one
(`tests/audit/test_history.py` checks the imports).

Read-only: opens the ledger without taking an epoch, so it never fences a running coordinator.
`--since` takes a UTC time (`2025-01-02`, `2025-01-02T03:04:05Z`) or an age (`90s`, `30m`, `2h`,
`7d`); `--outcome` one of published, restored, resumed, aborted, abandoned, or `open` (no terminal
event yet). `--json` prints a list of `{"checkpoint_id", "kind", "state", "outcome", "started_at",
"ended_at", "duration_s", "participants", "epoch", "calls", "failures", "recovered_by"}`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import anyio

from ledger import AttemptRow
from tools.audit.source import open_readonly
from tools.audit.timefmt import duration, short_at

OUTCOMES: Final = ("published", "restored", "resumed", "aborted", "abandoned", "open")
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
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--ledger", metavar="URL", help="ledger database URL")
    where.add_argument("--config", metavar="FILE", help="cluster config (its ledger is read)")
    parser.add_argument("--since", metavar="T", type=parse_since, help="attempts started at or after T")
    parser.add_argument("--outcome", metavar="O", choices=OUTCOMES, help="only this outcome (or `open`)")
    parser.add_argument(
        "--limit", metavar="N", type=_not_negative, default=0, help="only the N most recent (0: all)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.set_defaults(handler=handle)


async def read_rows(url: str, since: datetime | None, outcome: str | None) -> list[AttemptRow]:
    """Projection rows, oldest first; `outcome="open"` means no terminal event yet."""
    async with open_readonly(url) as ledger:
        if outcome == "open":
            return [r for r in await ledger.attempts(since=since) if r.outcome is None]
        return await ledger.attempts(since=since, outcome=outcome)


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


def to_json(row: AttemptRow) -> dict[str, Any]:
    return {
        "checkpoint_id": row.checkpoint_id,
        "kind": row.kind,
        "state": row.state,
        "outcome": row.outcome,
        "started_at": row.started_at,
        "ended_at": row.ended_at,
        "duration_s": duration_s(row),
        "participants": list(row.participants),
        "epoch": row.epoch,
        "calls": row.calls,
        "failures": row.failures,
        "recovered_by": row.recovered_by,
    }


def emit_rows(rows: list[AttemptRow]) -> None:
    """One JSON array on stdout, one compact row per line: the C encoder keeps this fast on tens of
    thousands of attempts (an indented dump goes through the pure-Python encoder)."""
    encode = json.JSONEncoder(sort_keys=True, ensure_ascii=False).encode
    body = ",\n".join(encode(to_json(row)) for row in rows)
    sys.stdout.write(f"[\n{body}\n]\n" if rows else "[]\n")
    sys.stdout.flush()


COLUMNS: Final = (
    "checkpoint",
    "kind",
    "outcome",
    "started (UTC)",
    "duration",
    "participants",
    "calls",
    "failures",
    "recovered by",
)
_RIGHT: Final = frozenset({"calls", "failures", "duration"})
#: Above this many rows the table is written as plain aligned text: rich measures every cell and
#: takes seconds on tens of thousands of rows.
RICH_MAX_ROWS: Final = 500


def cells(row: AttemptRow) -> list[str]:
    return [
        row.checkpoint_id,
        row.kind,
        row.outcome or f"open ({row.state})",
        short_at(row.started_at),
        duration(duration_s(row)) if row.ended_at else "-",
        ", ".join(row.participants),
        str(row.calls),
        str(row.failures),
        f"epoch {row.recovered_by}" if row.recovered_by is not None else "-",
    ]


def print_rich(rows: list[AttemptRow]) -> None:
    from rich.table import Table
    from rich.text import Text

    from tools.audit.present import RESULT_STYLE, widened
    from tools.cli.output import console

    table = Table(box=None, pad_edge=False)
    for column in COLUMNS:
        table.add_column(column, justify="right" if column in _RIGHT else "left")
    for row in rows:
        values = cells(row)
        styles = ["" for _ in values]
        styles[2] = RESULT_STYLE.get(row.outcome or "", "yellow")
        styles[7] = "red" if row.failures else ""
        table.add_row(*(Text(v, style=st) for v, st in zip(values, styles, strict=True)))
    widened(console).print(table)


def print_plain(rows: list[AttemptRow]) -> None:
    """The same table as aligned plain text (no colour), for very long histories."""
    grid = [list(COLUMNS), *(cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in grid) for i in range(len(COLUMNS))]
    out = sys.stdout
    try:
        for line in grid:
            parts = [
                value.rjust(width) if name in _RIGHT else value.ljust(width)
                for name, value, width in zip(COLUMNS, line, widths, strict=True)
            ]
            out.write("  ".join(parts).rstrip() + "\n")
        out.flush()
    except BrokenPipeError:  # `quiesce history | head`: the reader has had enough
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())


def handle(args: argparse.Namespace) -> int:
    if args.ledger:
        url = args.ledger
    else:
        from coordinator.config import load_config  # pydantic + YAML: only when a config is named

        url = load_config(args.config).ledger
    rows = anyio.run(read_rows, url, args.since, args.outcome)
    if args.limit:
        rows = rows[-args.limit :]
    if args.json:
        emit_rows(rows)
        return 0
    if not rows:
        from tools.cli.output import console

        console.print(
            "no attempts recorded" if args.since is None and args.outcome is None else "no attempts match"
        )
        return 0
    if len(rows) > RICH_MAX_ROWS:
        print_plain(rows)
    else:
        print_rich(rows)
    return 0
