"""`quiesce demo [--dir DIR]` — checkpoint a local reference Gym cluster mid-rollout, restore it into a
fresh one, and check the rollouts finish exactly as an uninterrupted run (see `tools/demo.py`).

Uses an embedded SQLite ledger and snapshots under DIR (default `./.quiesce-demo`, emptied first);
needs no config and no token (a random one is made, never printed). Exit 0 when everything matches.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import anyio

from tools.cli.output import console


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
        help="folder for the ledger, snapshots and cluster logs (emptied first; default ./.quiesce-demo)",
    )
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from tools.demo import run_demo

    code: int = anyio.run(run_demo, args.dir, console)
    return code
