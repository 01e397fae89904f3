"""`quiesce abort --config C [--json]` — roll back the attempt in progress.

Finds the newest attempt without a terminal event in the ledger and resumes every server it
touched, in resume order (a server that never paused is recorded as such); its staging folder is
removed. An attempt already published is resumed instead (outcome `published`). `--json`:
`{"checkpoint_id", "outcome", "servers"}` (`none` when nothing is in progress).
"""

from __future__ import annotations

import argparse
from typing import Any

from tools.cli.cluster_cmd import add_common, run_outcome


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "abort",
        help="roll back the attempt in progress",
        description="Roll back the newest attempt in progress (found in the ledger): resume what it touched.",
    )
    add_common(parser)
    parser.set_defaults(handler=lambda args: run_outcome(args, "abort"))
