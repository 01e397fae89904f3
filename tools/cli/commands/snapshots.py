"""`quiesce snapshots --config C [--prune K [--dry-run | --yes]] [-o FORMAT]` — the published snapshots.

Lists every quiesce snapshot of the config's folder, oldest first: id, created (UTC), size, files,
participants, and which one `LATEST` names (`-o wide` adds its path). `--prune K` first removes
all but the newest K (K >= 0) — never the one `LATEST` names, never anything that is not a quiesce
snapshot (rules: `coordinator/snapshots.py`). Reads no ledger and contacts no server.

Removing asks first:
- `--dry-run` lists what would be removed and removes nothing;
- on a terminal, the snapshots to remove are listed and removed once confirmed (`y`);
- otherwise (a script, a pipe) `--yes` is required: without it nothing is removed, exit 2.

`--json`: `{"folder", "snapshots": [{"id", "path", "created", "size", "files", "participants",
"latest"}], "removed": [ids], "would_remove"?: [ids]}`; `-o jsonl` one snapshot per line (a
removed one marked `"removed": true`, one `--dry-run` would remove `"would_remove": true`). Exit 0;
1 when the question was answered no.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from quiesce.coordinator.config import load_config
from quiesce.coordinator.snapshots import SnapshotInfo, list_published, prune
from quiesce.coordinator.wording import count
from quiesce.tools.audit.timefmt import short_at
from quiesce.tools.cli.cluster_cmd import add_common
from quiesce.tools.cli.flags import UsageError, add_output
from quiesce.tools.cli.output import console, emit_json, emit_jsonl, print_error


def _keep(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of snapshots to keep (0 or more)")
    return int(text)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "snapshots",
        help="list the published snapshots (and prune old ones)",
        description="List the published snapshots of the config's snapshots folder; --prune K keeps the "
        "newest K and the one LATEST names, and removes the other quiesce snapshots.",
    )
    add_common(parser)
    add_output(parser)
    parser.add_argument(
        "--prune", metavar="K", type=_keep, help="remove all but the newest K snapshots (LATEST is kept)"
    )
    confirm = parser.add_mutually_exclusive_group()
    confirm.add_argument(
        "--dry-run", action="store_true", help="with --prune: list what would be removed, remove nothing"
    )
    confirm.add_argument(
        "--yes", action="store_true", help="with --prune: remove without asking (needed off a terminal)"
    )
    parser.set_defaults(handler=handle)


def size_text(size: int) -> str:
    """`512 B`, `1.5 KiB`, `3.2 MiB`, ..."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def would_prune(listed: list[SnapshotInfo], keep: int) -> list[SnapshotInfo]:
    """What `prune(folder, keep)` removes from `listed` (oldest first, as `list_published` gives
    them): all but the newest `keep`, never `LATEST`'s (`publish.apply_retention`'s rule)."""
    return [info for info in listed[: max(0, len(listed) - keep)] if not info.latest]


def _print(listed: list[SnapshotInfo], removed: list[SnapshotInfo], folder: str, *, wide: bool) -> None:
    from rich.table import Table

    from quiesce.tools.audit.present import ColumnSpec, add_columns, widened
    from quiesce.tools.cli.safe_text import escape

    for info in removed:
        console.print(f"removed {escape(info.id)} ({size_text(info.size)})", soft_wrap=True)
    if not listed:
        console.print(f"no snapshots in {escape(folder)}", soft_wrap=True)
        return
    out = widened(console)
    table = Table(title=f"snapshots in {escape(folder)}", title_justify="left", box=None, pad_edge=False)
    specs = [
        ColumnSpec("id", [info.id for info in listed], "whole"),
        ColumnSpec("created (UTC)", [short_at(info.created) for info in listed], "free"),
        ColumnSpec("size", [size_text(info.size) for info in listed], "compact", "right"),
        ColumnSpec("files", [str(info.files) for info in listed], "compact", "right"),
        ColumnSpec("participants", [", ".join(info.participants) for info in listed], "free"),
        ColumnSpec("latest", ["LATEST" if info.latest else "" for info in listed], "compact"),
        *([ColumnSpec("path", [str(info.path) for info in listed], "whole")] if wide else []),
    ]
    add_columns(table, specs, out.width)
    for row in zip(*(spec.values for spec in specs), strict=True):
        table.add_row(*(escape(str(value)) for value in row))
    out.print(table)
    _warn_poisoned_latest(Path(folder))


def _warn_poisoned_latest(folder: Path) -> None:
    """A `LATEST` that exists but names no snapshot folder is said so on stderr (a restore of
    `latest` would be refused); a missing one is not news."""
    from quiesce.coordinator.publish import latest_problem
    from quiesce.tools.cli import output
    from quiesce.tools.cli.safe_text import escape

    problem = latest_problem(folder)
    if problem is not None and not problem.endswith(" is missing"):
        output.err_console.print(
            f"warning: {escape(problem)}; a restore of `latest` is refused until a save rewrites it",
            soft_wrap=True,
        )


def _confirmed(doomed: list[SnapshotInfo], keep: int, folder: Path) -> bool:
    """Ask on the terminal whether to remove `doomed` (listed first); True only for yes."""
    from quiesce.tools.cli import output
    from quiesce.tools.cli.safe_text import escape

    err = output.err_console
    err.print(
        f"--prune {keep} removes {count(len(doomed), 'snapshot')} from {escape(str(folder))}:", soft_wrap=True
    )
    for info in doomed:
        err.print(
            f"  {escape(info.id)} ({size_text(info.size)}, created {short_at(info.created)})", soft_wrap=True
        )
    err.print("remove them? [y/N] ", end="", markup=False)
    answer = sys.stdin.readline()  # "" at end of input: no
    return answer.strip().lower() in ("y", "yes")


def handle(args: argparse.Namespace) -> int:
    if args.prune is None and (args.dry_run or args.yes):
        raise UsageError(f"{'--dry-run' if args.dry_run else '--yes'} goes with --prune K")
    asks = args.prune is not None and not args.dry_run and not args.yes
    if asks and not sys.stdin.isatty():
        raise UsageError(
            f"--prune {args.prune} removes snapshots and there is no terminal to confirm on: add --yes to"
            " remove them, or --dry-run to list what would be removed"
        )
    folder = load_config(args.config).snapshots
    removed: list[SnapshotInfo] = []
    doomed: list[SnapshotInfo] | None = None
    if args.prune is not None:
        doomed = would_prune(list_published(folder), args.prune)
        if args.dry_run:
            pass
        elif doomed and asks and not _confirmed(doomed, args.prune, folder):
            print_error("nothing removed")
            return 1
        else:
            removed = prune(folder, args.prune)
    listed = list_published(folder)
    if args.output == "jsonl":
        marked = {info.id for info in doomed or ()} if args.dry_run else set()
        emit_jsonl(
            [{**info.as_json(), "removed": True} for info in removed]
            + [{**info.as_json(), **({"would_remove": True} if info.id in marked else {})} for info in listed]
        )
    elif args.json:
        document: dict[str, Any] = {
            "folder": str(folder),
            "snapshots": [info.as_json() for info in listed],
            "removed": [info.id for info in removed],
        }
        if args.dry_run and doomed is not None:
            document["would_remove"] = [info.id for info in doomed]
        emit_json(document)
    else:
        if args.dry_run and doomed is not None:
            from quiesce.tools.cli.safe_text import escape

            for info in doomed:
                console.print(f"would remove {escape(info.id)} ({size_text(info.size)})", soft_wrap=True)
            if not doomed:
                console.print(f"--prune {args.prune} would remove nothing")
        _print(listed, removed, str(folder), wide=args.output == "wide")
    return 0
