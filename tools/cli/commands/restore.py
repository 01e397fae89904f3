"""`quiesce restore --config C | --service URL [--snapshot DIR|ID|latest] [--resume] [--json]`.

`--snapshot` takes a snapshot id (looked up in the config's snapshots folder first, so a folder of
the same name in the current folder never stands in for it), `latest`, or a snapshot folder's path;
one that is not there is bad usage (exit 2).
Verifies the snapshot (every file and checksum, participants equal to discovery's) before
contacting any server, then restores policy → agents → resources (on Gym's unified plane: every
server at once with the snapshot's episodes; all or nothing). The servers stay paused until
`quiesce resume` — or, with `--resume`, are resumed at once: the restore is not finished until
that resume is (killed on the way, `quiesce recover` finishes it). Refused before any request
while a participant is held by another checkpoint id (the message names it and what frees it).
`--json`: `{"checkpoint_id", "outcome", "servers", "resubmit", "restart", "resubmit_unknown"}` with
outcome `restored` (or `resumed` with `--resume`, `failed` on a failed phase, `refused` when held).

What to send again: the restore runs no restored rollout — Gym retired each saved execution and
continues it only when the trainer sends `/run` for it as its next attempt. A successful restore
prints one line per such execution (`send again: rollout X as attempt N on AGENT`) and lists them
under `resubmit` (`[{"server", "rollout_id", "attempt_index"}]`, empty when none; `Attempt.resubmit`).
An agent whose saved folder does not say which (another layout, a file that is not a record) is
listed under `resubmit_unknown` (`[{"server", "reason"}]`; a `resubmissions unknown on AGENT:
REASON` line): its state was restored all the same. A saved turn that depends on a `restart_only`
resources server was discarded on an agent that can (Gym's `discard_restored_continuation_v1`):
listed under `restart` (same shape as `resubmit`; a `start afresh: ...` line), its `/run` starts
from the task.
On the unified plane these are the replacement attempts the trainer starts once resumed (`start:
rollout X attempt N on SERVER`, SERVER the environment that continues it); `--json` adds `plane`.

`--service URL` drives a running `quiesce serve` instead of opening the ledger; the service looks
the snapshot up in its own config's folder.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import anyio

from quiesce.coordinator import Attempt, Coordinator, PhaseError, ServersHeld, SnapshotError
from quiesce.coordinator.publish import resolve_snapshot
from quiesce.coordinator.wording import count
from quiesce.tools.cli.cluster_cmd import (
    add_common,
    config_of,
    driving,
    frees,
    phase_error_json,
    print_continuations,
    print_restored_again,
    print_resubmit,
    print_warnings,
    progress_line,
)
from quiesce.tools.cli.flags import UsageError
from quiesce.tools.cli.output import console, emit_json, print_error
from quiesce.tools.cli.safe_text import escape
from quiesce.tools.cli.signals import SignalStop, abandoned, interrupted, past_the_point, records_since

if TYPE_CHECKING:
    from quiesce.ledger import Event


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "restore",
        help="restore a snapshot into the Gym servers (they stay paused until resume)",
        description="Verify a snapshot, then restore it into every participating Gym server.",
    )
    add_common(parser, service=True)
    parser.add_argument(
        "--snapshot", default="latest", metavar="DIR|ID|latest", help="snapshot to restore (default: latest)"
    )
    parser.add_argument("--resume", action="store_true", help="resume the servers after a successful restore")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    config = config_of(args)
    if config is not None and args.snapshot != "latest":
        # naming a snapshot that is not there is bad usage (exit 2), found before any server is asked
        try:
            named = resolve_snapshot(config.snapshots, args.snapshot)
        except SnapshotError as error:
            raise UsageError(str(error), code="snapshot") from None
        if not named.is_dir():
            raise UsageError(f"--snapshot {args.snapshot}: no such snapshot folder", code="snapshot")
    attempt: Attempt | None = None
    failure: PhaseError | None = None
    refused: ServersHeld | None = None

    stop = SignalStop()
    records: list[Event] = []

    async def run() -> None:
        nonlocal attempt, failure, refused
        async with stop.watching():
            with progress_line() as progress:
                async with driving(args, config, on_progress=progress) as coord:
                    local = coord if isinstance(coord, Coordinator) else None
                    after = await local.ledger.last_seq() if local is not None else 0
                    with stop.operation(lambda: past_the_point(local.current if local else None)):
                        found = await coord.discover()
                        print_warnings(found.warnings)
                        try:
                            attempt = await coord.restore(args.snapshot, resume=args.resume)
                        except PhaseError as error:
                            failure = error
                            attempt = local.current if local is not None else None
                        except ServersHeld as error:
                            refused = error
                    if stop.received is not None and local is not None:
                        records.extend(await records_since(local.ledger, after))

    anyio.run(run)
    if stop.received is not None:
        if args.service:
            raise abandoned(stop.received, args.service)
        raise interrupted(stop.received, records, frees(args))
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
        print_warnings(failure.warnings)  # e.g. provenance: it still holds for what failed
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
                "restart": [r.as_json() for r in attempt.restart],
                "resubmit_unknown": [u.as_json() for u in attempt.resubmit_unknown],
                "plane": attempt.plane,
                **({"restored_again": list(again)} if again else {}),
            }
        )
    else:
        console.print(
            f"{outcome} {escape(str(attempt.snapshot))} as {escape(attempt.checkpoint_id)}:"
            f" {escape(', '.join(attempt.touched))}"
            + ("" if args.resume else escape(f" (paused until `quiesce resume {frees(args)}`)")),
            soft_wrap=True,
        )
        print_restored_again(again)
        if attempt.resubmit and attempt.plane == "v2":
            when = "now" if args.resume else "once resumed"
            rollouts = count(len(attempt.resubmit), "restored rollout")
            console.print(
                f"{rollouts} continue only as their replacement attempts: start these attempts {when}"
                " (each continues from its saved turn; Gym starts none by itself):",
                soft_wrap=True,
            )
        elif attempt.resubmit:
            when = "now" if args.resume else "once resumed"
            rollouts = count(len(attempt.resubmit), "restored rollout")
            runs = "runs" if len(attempt.resubmit) == 1 else "run"
            console.print(f"{rollouts} {runs} only when sent again ({when}), as:", soft_wrap=True)
        print_resubmit(attempt.resubmit, plane=attempt.plane)
        print_continuations(attempt.restart, attempt.resubmit_unknown)
    return 0
