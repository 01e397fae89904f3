"""`quiesce recover --config C [--json]` — finish or roll back what a dead coordinator left.

Takes a new epoch (fencing the dead coordinator), then for every unfinished attempt (no terminal
event, or a restore whose resume began after it was left paused): settles each server it touched
(capabilities, recorded), and resumes them (a save before publication), finishes the publication
the filesystem shows happened (then resumes), re-drives an interrupted restore whose snapshot is
intact — then resumes it if it was a `restore --resume` or its resume had begun, else the servers
stay paused until `quiesce resume` — or abandons a restore whose snapshot is gone (the servers stay
paused; the output says how to proceed). Orphaned staging folders are removed. A second run makes
no call.

`--json`: `{"epoch", "attempts": [{"checkpoint_id", "found", "action", "servers": [{"name",
"reported_phase", "result", "detail"?}], "message", "resubmit"?}], "swept_staging"}` with action
`resumed | published | restored | abandoned | none`; a restore it finished lists what to send
`/run` for again (`resubmit`, and a `send again: ...` line each in the human output). Exit 1
when a server could not be resumed or a restore was abandoned, else 0.
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from quiesce.coordinator import Coordinator, load_config
from quiesce.coordinator.recovery import RecoveryReport
from quiesce.tools.cli import output
from quiesce.tools.cli.cluster_cmd import add_common, print_continuations, print_resubmit, progress_line
from quiesce.tools.cli.output import emit_json, print_error


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "recover",
        help="finish or roll back what a dead coordinator left (resume every server it paused)",
        description="Take a new epoch and recover every attempt a dead coordinator left unfinished.",
    )
    add_common(parser)
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    found: list[RecoveryReport] = []

    async def run() -> None:
        with progress_line() as progress:
            async with Coordinator.open(config, on_progress=progress, recover=False) as coord:
                found.append(await coord.recover())

    anyio.run(run)
    report = found[0]
    if args.json:
        emit_json(report.as_json())
    else:
        _print_report(report)
    if not report.ok:
        problems = [a.message for a in report.attempts if a.action == "abandoned" or a.left_paused]
        print_error(" ".join(problems))
        return 1
    return 0


def _print_report(report: RecoveryReport) -> None:
    from quiesce.tools.cli.safe_text import escape  # people-facing output only: --json never loads rich

    console = output.console
    if not report.attempts:
        console.print(f"nothing to recover (epoch {report.epoch})")
    for attempt in report.attempts:
        servers = ", ".join(f"{s.name} {s.result}" for s in attempt.servers) or "no server"
        console.print(
            f"{escape(attempt.checkpoint_id)} ({escape(attempt.kind)}, found {escape(attempt.found)}):"
            f" {attempt.action} — {escape(servers)}"
        )
        if attempt.message:
            console.print(f"  {escape(attempt.message)}")
        print_resubmit(attempt.resubmit, indent="  ")
        print_continuations(attempt.restart, attempt.resubmit_unknown, indent="  ")
    if report.swept:
        console.print(f"removed orphaned staging folders: {escape(', '.join(report.swept))}")
