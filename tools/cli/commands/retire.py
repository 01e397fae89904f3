"""`quiesce retire --config C | --service URL [--episodes FILE|-] [ROLLOUT[:ATTEMPT] ...] [--deadline-s N]
[--json]` — stop these attempts on every server of Gym's unified plane, and refuse them until `forget`.

Rules:
- The episodes come from `--episodes` (JSON lines, `tools/cli/episodes.py`) and the arguments
  (`r0`, `r0:1`); at least one. A bad one is bad usage (exit 2) before anything is sent.
- Unified plane only: asked of a v1 cluster it is bad usage (exit 2), after discovery, before any
  retire is sent.
- The coordinator sends it callers first (environment → agent → model and resources) and records
  every call; a server that fails it (one holding a checkpoint answers "resume first") makes the
  command exit 1 naming it — retire again once fixed (it is idempotent).
- `--json`: `{"operation": "retire", "outcome": "retired"|"failed", "checkpoint_id", "items"
  (capture keys), "servers", "failed": {server: why}, "error"?}`.

`forget.py` shares `run` (the same flags, order and output, for rollout ids).
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from quiesce.coordinator import PhaseError, RetireOutcome
from quiesce.coordinator.config import check_deadline
from quiesce.coordinator.protocol_v2 import unique_episodes
from quiesce.coordinator.wording import count
from quiesce.tools.cli import output
from quiesce.tools.cli.cluster_cmd import (
    Driver,
    add_common,
    config_of,
    driving,
    escape,
    phase_error_json,
    print_warnings,
    progress_line,
    require_unified,
)
from quiesce.tools.cli.episodes import FILE_HELP, episodes_of
from quiesce.tools.cli.flags import FILE_COMPLETION, UsageError, seconds
from quiesce.tools.cli.output import emit_json, print_error

#: What each operation did, for people (the items, then the servers, follow).
DONE = {"retire": "retired", "forget": "forgot"}
#: What follows for the items, for people.
MEANS = {
    "retire": "each server refuses them (stale_attempt) until `quiesce forget` of their rollouts",
    "forget": "their rollouts' later attempts are accepted again",
}


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "retire",
        help="unified plane: stop these attempts on every server; refuse them until forget",
        description="Retire episode attempts on every server of Gym's unified plane (environment →"
        " agent → model and resources): each stops them, and every earlier attempt of their"
        " rollouts, and refuses them until `quiesce forget`.",
    )
    parser.add_argument(
        "episodes",
        metavar="ROLLOUT[:ATTEMPT]",
        nargs="*",
        help="an episode to retire: its rollout id, and :N for attempt N (default 0)",
    )
    source = parser.add_argument("--episodes", dest="episodes_file", metavar="FILE|-", help=FILE_HELP)
    source.complete = FILE_COMPLETION  # type: ignore[attr-defined]  # read by shtab
    add_operation_flags(parser)
    parser.set_defaults(handler=handle)


def add_operation_flags(parser: argparse.ArgumentParser) -> None:
    """`--config` / `--service` and `--deadline-s`, as retire and forget take them."""
    add_common(parser, service=True)
    parser.add_argument(
        "--deadline-s",
        type=seconds,
        default=None,
        metavar="N",
        help="budget of the operation in seconds, at most the config's max_deadline_s (default: deadline_s)",
    )


def handle(args: argparse.Namespace) -> int:
    episodes = unique_episodes(episodes_of(args.episodes, args.episodes_file))  # exit 2 before anything
    if not episodes:
        raise UsageError("name at least one episode: ROLLOUT[:ATTEMPT] arguments, or --episodes FILE|-")
    items = [e.capture_key for e in episodes]
    return run(args, "retire", items, lambda coord: coord.retire(episodes, deadline_s=args.deadline_s))


def run(
    args: argparse.Namespace,
    operation: str,
    items: list[str],
    call: Callable[[Driver], Awaitable[RetireOutcome]],
) -> int:
    """Discover, refuse a v1 cluster (exit 2), run `call`, print what it did; exit 1 on a failure."""
    config = config_of(args)
    if config is not None:
        check_deadline(config, args.deadline_s, what="--deadline-s")  # exit 2 before the ledger is opened
    done: RetireOutcome | None = None
    failure: PhaseError | None = None

    async def go() -> None:
        nonlocal done, failure
        with progress_line() as progress:
            async with driving(args, config, on_progress=progress) as coord:
                found = await coord.discover()
                print_warnings(found.warnings)
                require_unified(found, f"quiesce {operation}")
                try:
                    done = await call(coord)
                except PhaseError as error:
                    failure = error

    anyio.run(go)
    if failure is not None:
        if args.json:
            emit_json(
                {
                    "operation": operation,
                    "outcome": "failed",
                    "checkpoint_id": failure.checkpoint_id,
                    "items": items,
                    "error": phase_error_json(failure),
                }
            )
        print_error(failure)
        return 1
    assert done is not None
    if args.json:
        emit_json({**done.as_json(), "outcome": "retired" if operation == "retire" else "forgotten"})
        return 0
    servers = ", ".join(done.servers) or "no server"
    output.console.print(
        escape(
            f"{DONE[operation]} {', '.join(done.items)} on {count(len(done.servers), 'server')}"
            f" ({servers}; id {done.checkpoint_id}): {MEANS[operation]}"
        ),
        soft_wrap=True,
    )
    return 0
