"""`quiesce snapshots --config C [--prune K] [--json]` — the published snapshots of the config's folder.

Lists every quiesce snapshot, oldest first: id, created (UTC), size, files, participants, and which
one `LATEST` names. `--prune K` first removes all but the newest K (K >= 0) — never the one
`LATEST` names, never anything that is not a quiesce snapshot (rules: `coordinator/snapshots.py`).
Reads no ledger and contacts no server. `--json`: `{"folder", "snapshots": [{"id", "path",
"created", "size", "files", "participants", "latest"}], "removed": [ids]}`. Exit 0.
"""

from __future__ import annotations

import argparse
from typing import Any

from quiesce.coordinator.config import load_config
from quiesce.coordinator.snapshots import SnapshotInfo, list_published, prune
from quiesce.tools.audit.timefmt import short_at
from quiesce.tools.cli.cluster_cmd import add_common
from quiesce.tools.cli.output import console, emit_json


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
    parser.add_argument(
        "--prune", metavar="K", type=_keep, help="remove all but the newest K snapshots (LATEST is kept)"
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


def _print(listed: list[SnapshotInfo], removed: list[SnapshotInfo], folder: str) -> None:
    from rich.markup import escape
    from rich.table import Table

    from quiesce.tools.audit.present import widened

    for info in removed:
        console.print(f"removed {escape(info.id)} ({size_text(info.size)})")
    if not listed:
        console.print(f"no snapshots in {escape(folder)}")
        return
    table = Table(title=f"snapshots in {escape(folder)}", title_justify="left", box=None, pad_edge=False)
    for column in ("id", "created (UTC)", "size", "files", "participants", "latest"):
        table.add_column(column, justify="right" if column in ("size", "files") else "left")
    for info in listed:
        table.add_row(
            escape(info.id),
            short_at(info.created),
            size_text(info.size),
            str(info.files),
            escape(", ".join(info.participants)),
            "LATEST" if info.latest else "",
        )
    widened(console).print(table)


def handle(args: argparse.Namespace) -> int:
    folder = load_config(args.config).snapshots
    removed = prune(folder, args.prune) if args.prune is not None else []
    listed = list_published(folder)
    if args.json:
        emit_json(
            {
                "folder": str(folder),
                "snapshots": [info.as_json() for info in listed],
                "removed": [info.id for info in removed],
            }
        )
    else:
        _print(listed, removed, str(folder))
    return 0
