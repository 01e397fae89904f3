"""`quiesce restore --config C [--snapshot DIR|ID|latest] [--resume] [--json]`.

`--snapshot` takes a snapshot id (looked up in the config's snapshots folder first, so a folder of
the same name in the current folder never stands in for it), `latest`, or a snapshot folder's path;
one that is not there is bad usage (exit 2).
Verifies the snapshot (every file and checksum, participants equal to discovery's) before
contacting any server, then restores policy → agents → resources. The servers stay paused until
`quiesce resume` — or, with `--resume`, are resumed at once: the restore is not finished until
that resume is (killed on the way, `quiesce recover` finishes it). Refused before any request
while a participant is held by another checkpoint id (the message names it and what frees it).
`--json`: `{"checkpoint_id", "outcome", "servers", "resubmit"}` with outcome `restored` (or
`resumed` with `--resume`, `failed` on a failed phase, `refused` when held).

What to send again: the restore runs no restored rollout — Gym retired each saved execution and
continues it only when the trainer sends `/run` for it as its next attempt. A successful restore
prints one line per such execution (`send again: rollout X as attempt N on AGENT`) and lists them
under `resubmit` (`[{"server", "rollout_id", "attempt_index"}]`, empty when none; `Attempt.resubmit`).
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio
from rich.markup import escape

from quiesce.coordinator import Attempt, Coordinator, PhaseError, ServersHeld, SnapshotError, load_config
from quiesce.coordinator.publish import resolve_snapshot
from quiesce.tools.cli.cluster_cmd import (
    add_common,
    phase_error_json,
    print_restored_again,
    print_resubmit,
    print_warnings,
    progress_line,
)
from quiesce.tools.cli.output import console, emit_json, print_error


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "restore",
        help="restore a snapshot into the Gym servers (they stay paused until resume)",
        description="Verify a snapshot, then restore it into every participating Gym server.",
    )
    add_common(parser)
    parser.add_argument(
        "--snapshot", default="latest", metavar="DIR|ID|latest", help="snapshot to restore (default: latest)"
    )
    parser.add_argument("--resume", action="store_true", help="resume the servers after a successful restore")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.snapshot != "latest":
        # naming a snapshot that is not there is bad usage (exit 2), found before any server is asked
        try:
            named = resolve_snapshot(config.snapshots, args.snapshot)
        except SnapshotError as error:
            print_error(error)
            return 2
        if not named.is_dir():
            print_error(f"--snapshot {args.snapshot}: no such snapshot folder")
            return 2
    attempt: Attempt | None = None
    failure: PhaseError | None = None
    refused: ServersHeld | None = None

    async def run() -> None:
        nonlocal attempt, failure, refused
        with progress_line() as progress:
            async with Coordinator.open(config, on_progress=progress, config_path=args.config) as coord:
                found = await coord.discover()
                print_warnings(found.warnings)
                try:
                    attempt = await coord.restore(args.snapshot, resume=args.resume)
                except PhaseError as error:
                    failure = error
                    attempt = coord.current
                except ServersHeld as error:
                    refused = error

    anyio.run(run)
    if refused is not None:
        if args.json:
            emit_json({"checkpoint_id": None, "outcome": "refused", "servers": [], "held": refused.held})
        print_error(refused)
        return 1
    if failure is not None:
        document: dict[str, Any] = {
            "checkpoint_id": failure.checkpoint_id,
            "outcome": "failed",
            "servers": list(attempt.touched) if attempt else [],
            "error": phase_error_json(failure),
        }
        if args.json:
            emit_json(document)
        print_error(failure)
        return 1
    assert attempt is not None
    print_warnings(attempt.warnings)
    outcome = "resumed" if args.resume else "restored"
    again = attempt.resume_outcome.restored_again if attempt.resume_outcome else ()
    if args.json:
        emit_json(
            {
                "checkpoint_id": attempt.checkpoint_id,
                "outcome": outcome,
                "servers": list(attempt.touched),
                "resubmit": [r.as_json() for r in attempt.resubmit],
                **({"restored_again": list(again)} if again else {}),
            }
        )
    else:
        console.print(
            f"{outcome} {escape(str(attempt.snapshot))} as {escape(attempt.checkpoint_id)}:"
            f" {escape(', '.join(attempt.touched))}"
            + ("" if args.resume else escape(f" (paused until `quiesce resume --config {args.config}`)"))
        )
        print_restored_again(again)
        if attempt.resubmit:
            when = "now" if args.resume else "once resumed"
            console.print(
                f"{len(attempt.resubmit)} restored rollouts run only when sent again ({when}), as:",
                soft_wrap=True,
            )
        print_resubmit(attempt.resubmit)
    return 0
