"""`quiesce resume --config C [--json]` — resume every server a restore or an attempt left paused.

Works from the ledger alone (any process): it finds the newest attempt without a terminal event,
a restore not yet resumed, or a rollback that left servers paused, and resumes its servers under
that attempt's checkpoint id. An attempt still before publication is rolled back (outcome
`aborted`); a published one is finished (`published`). `--json`: `{"checkpoint_id", "outcome",
"servers"}` (`none` when nothing was paused).
"""

from __future__ import annotations

import argparse
from typing import Any

from tools.cli.cluster_cmd import add_common, run_outcome


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "resume",
        help="resume every server a restore or an attempt left paused",
        description="Resume the servers the newest restore or attempt left paused (found in the ledger).",
    )
    add_common(parser)
    parser.set_defaults(handler=lambda args: run_outcome(args, "resume"))
