"""`quiesce forget --config C | --service URL ROLLOUT ... [--deadline-s N] [--json]` — drop the retire
marks of these rollouts on every server of Gym's unified plane (once a rollout is finished for good).

Rules: the rollout ids are checked as Gym checks them (bad usage, exit 2, before anything is sent),
sent deduplicated and sorted; otherwise as `quiesce retire` (`retire.run`: unified plane only, the
same order, exit 1 naming a server that failed). `--json`: `{"operation": "forget", "outcome":
"forgotten"|"failed", "checkpoint_id", "items" (rollout ids), "servers", "failed", "error"?}`.
"""

from __future__ import annotations

import argparse
from typing import Any

from quiesce.tools.cli.commands.retire import add_operation_flags, run
from quiesce.tools.cli.episodes import episode_arg
from quiesce.tools.cli.flags import UsageError


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "forget",
        help="unified plane: stop refusing retired rollouts on every server",
        description="Forget the retire marks of rollouts on every server of Gym's unified plane, so"
        " their later attempts are accepted again (once a rollout is finished for good).",
    )
    parser.add_argument("rollout_ids", metavar="ROLLOUT", nargs="+", help="a rollout id to forget")
    add_operation_flags(parser)
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    rollouts: list[str] = []
    for text in args.rollout_ids:
        if ":" in text:
            raise UsageError(f"{text!r}: forget takes rollout ids, without an attempt (ROLLOUT, e.g. r0)")
        rollouts.append(episode_arg(text).rollout_id)  # checked as Gym checks it: exit 2
    chosen = sorted(set(rollouts))
    return run(args, "forget", chosen, lambda coord: coord.forget(chosen, deadline_s=args.deadline_s))
