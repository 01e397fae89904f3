"""`quiesce checkpoint --config C | --service URL [--deadline-s N] [--json]` — prepare → commit →
publish → resume.

Prints the published snapshot: one line `published ID -> PATH` on stdout (progress is on stderr),
so a script can read it from a pipe. `--service URL` drives a running `quiesce serve` instead of
opening the ledger (which that service holds). On failure the attempt is rolled back (every touched server
resumed) and the command exits 1, naming the phase, the server, the reason, who was resumed,
who could not be, and the latest snapshot still in place. While a participant is held by another
checkpoint id (a restore waiting for its resume, an attempt a dead coordinator left) nothing is
sent: it exits 1 naming the holder, its kind, since when and the command that frees it. `--json`
prints `{"checkpoint_id", "outcome": "published"|"aborted"|"refused", "snapshot", "participants",
"skipped", "error"?, "resumed"?, "not_resumed"?, "held"?}`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import anyio

from quiesce.coordinator import Attempt, Coordinator, Discovery, PhaseError, ServersHeld
from quiesce.coordinator.config import check_deadline
from quiesce.tools.cli.cluster_cmd import (
    add_common,
    config_of,
    driving,
    escape,
    phase_error_json,
    print_warnings,
    progress_line,
)
from quiesce.tools.cli.flags import seconds
from quiesce.tools.cli.output import console, emit_json, print_error


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "checkpoint",
        help="checkpoint every Gym server: prepare, commit, publish, resume",
        description="Bring every participating Gym server to one consistent stop, save, publish, resume.",
    )
    add_common(parser, service=True)
    parser.add_argument(
        "--deadline-s",
        type=seconds,
        default=None,
        metavar="N",
        help="budget of the attempt in seconds, at most the config's max_deadline_s (default: deadline_s)",
    )
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    config = config_of(args)
    if config is not None:
        check_deadline(config, args.deadline_s, what="--deadline-s")  # exit 2 before the ledger is opened
    found: Discovery | None = None
    attempt: Attempt | None = None
    failure: PhaseError | None = None
    refused: ServersHeld | None = None

    async def run() -> None:
        nonlocal found, attempt, failure, refused
        with progress_line() as progress:
            async with driving(args, config, on_progress=progress) as coord:
                found = await coord.discover()
                print_warnings(found.warnings)
                try:
                    attempt = await coord.checkpoint(deadline_s=args.deadline_s)
                except PhaseError as error:
                    failure = error
                    attempt = coord.current if isinstance(coord, Coordinator) else None
                except ServersHeld as error:
                    refused = error

    anyio.run(run)
    assert found is not None
    if refused is not None:
        if args.json:
            emit_json(
                {
                    "checkpoint_id": None,
                    "outcome": "refused",
                    "snapshot": None,
                    "participants": found.names,
                    "skipped": [{"name": n, "reason": r} for n, r in found.skipped],
                    "held": refused.held,
                    "error": {"phase": None, "server": None, "code": None, "message": str(refused)},
                }
            )
        print_error(refused)
        return 1
    if attempt is not None:
        print_warnings(attempt.warnings)
    published = attempt is not None and attempt.snapshot is not None
    document: dict[str, Any] = {
        "checkpoint_id": attempt.checkpoint_id if attempt else (failure.checkpoint_id if failure else None),
        "outcome": "published" if published else "aborted",
        "snapshot": str(attempt.snapshot) if attempt and attempt.snapshot else None,
        "participants": found.names,
        "skipped": [{"name": n, "reason": r} for n, r in found.skipped],
    }
    if failure is not None:
        document["error"] = phase_error_json(failure)
        document["resumed"] = failure.resumed
        document["not_resumed"] = failure.not_resumed
    if args.json:
        emit_json(document)
    elif failure is None:
        line = f"published {document['checkpoint_id']} -> {document['snapshot']}"
        if sys.stdout.isatty():
            console.print(escape(line), soft_wrap=True)
        else:  # a pipe: exactly this one line, never wrapped
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
    if failure is not None:
        print_error(failure)
        return 1
    return 0
