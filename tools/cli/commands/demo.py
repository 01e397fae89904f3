"""`quiesce demo [--dir DIR] [--plane v1|v2] [--json]` — checkpoint a local reference Gym cluster
mid-rollout, restore it into a fresh one, and check the rollouts finish exactly as an uninterrupted
run (see `tools/demo.py`; `--plane v2`: Gym's unified plane, `tools/demo_v2.py`).

Uses an embedded SQLite ledger and snapshots under DIR (default `./.quiesce-demo`); needs no config
and no token (a random one is made, never printed). DIR must be new, empty, or one an earlier demo
made (it carries the demo's marker): then only what the demo wrote there is removed. Any other
non-empty folder is refused, exit 2, before anything runs. Exit 0 when everything matches, 1 when not.
`--json`: the story goes to stderr, and stdout gets `{"ok", "dir", "ledger", "snapshots",
"rollouts", "checkpoint_id", "restored_as", "differences", "elapsed_s", "error"}`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import anyio

from quiesce.tools.cli.flags import UsageError
from quiesce.tools.cli.output import console, emit_json


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo",
        help="checkpoint a local reference Gym cluster mid-rollout and restore it into a fresh one",
        description=(
            "Start a local reference Gym cluster, checkpoint it mid-rollout, kill it, restore the snapshot "
            "into a fresh cluster, and check the rollouts finish exactly as an uninterrupted run."
        ),
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(".quiesce-demo"),
        help="folder for the ledger, snapshots and cluster logs: new, empty, or made by an earlier demo"
        " (default ./.quiesce-demo)",
    )
    parser.add_argument(
        "--plane",
        choices=("v1", "v2"),
        default="v1",
        help="the checkpoint control plane the reference cluster speaks: v1 (default), or v2 — Gym's"
        " unified plane (/ng-control/v1/checkpoint/*)",
    )
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from rich.console import Console

    from quiesce.tools.demo import FolderRefused, run_demo

    result: dict[str, Any] = {}
    people = Console(stderr=True, highlight=False) if args.json else console
    try:
        code: int = anyio.run(lambda: run_demo(args.dir, people, result, plane=args.plane))
    except FolderRefused as error:
        raise UsageError(str(error)) from None
    if args.json:
        emit_json(result)
    return code
