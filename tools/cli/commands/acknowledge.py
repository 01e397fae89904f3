"""`quiesce acknowledge --config C | --service URL SERVER ROLLOUT_ID:ATTEMPT_INDEX [...] [--json]` — release
finished results.

Gym keeps every finished rollout on its agent until the consumer acknowledges it; until then that
agent's prepare is incomplete and a checkpoint can only roll back at its deadline. Once the trainer
holds a result, this command (or `Coordinator.acknowledge_completed`) tells the agent so.

Exit codes: 0 every execution acknowledged; 1 the agent refused or answered another set (nothing is
assumed released); 2 bad usage — a malformed `ROLLOUT_ID:ATTEMPT_INDEX`, a duplicate, a server not in
the config or one whose capabilities do not list `completed_result_acknowledgement`. `--json`:
`{"server", "acknowledged": [{"rollout_id", "attempt_index"}], "outcome": "acknowledged"}`, or with
`"outcome": "failed"` and an `error` object. `--service URL` sends it through a running `quiesce
serve` (which holds the ledger) instead.
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from quiesce.coordinator.errors import AcknowledgementError
from quiesce.tools.cli import output
from quiesce.tools.cli.cluster_cmd import add_common, config_of, driving, escape
from quiesce.tools.cli.output import emit_json, print_error


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "acknowledge",
        help="acknowledge finished rollout results an agent holds",
        description=(
            "Tell an agent that the trainer now holds these finished rollout results, so the agent "
            "releases them (Gym's acknowledge-completed). Until then the agent's prepare is incomplete."
        ),
    )
    add_common(parser, service=True)
    parser.add_argument("server", metavar="SERVER", help="the agent's name in the config")
    parser.add_argument(
        "executions",
        metavar="ROLLOUT_ID:ATTEMPT_INDEX",
        nargs="+",
        type=_execution,
        help="a finished execution, e.g. r0:0 (the attempt index after the last colon)",
    )
    parser.set_defaults(handler=handle)


def _execution(text: str) -> tuple[str, int]:
    rollout, sep, index = text.rpartition(":")
    if not sep or not rollout or not index.isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not ROLLOUT_ID:ATTEMPT_INDEX (e.g. r0:0; the attempt index is a number >= 0)"
        )
    return rollout, int(index)


def handle(args: argparse.Namespace) -> int:
    config = config_of(args)
    executions: list[tuple[str, int]] = list(args.executions)
    acknowledged: list[tuple[str, int]] = []
    failure: AcknowledgementError | None = None

    async def run() -> None:
        nonlocal acknowledged, failure
        async with driving(args, config, recover=False) as coord:
            try:
                acknowledged = await coord.acknowledge_completed(args.server, executions)
            except AcknowledgementError as error:
                failure = error

    anyio.run(run)
    if failure is not None:
        if args.json:
            emit_json(
                {
                    "server": args.server,
                    "acknowledged": [],
                    "outcome": "failed",
                    "error": {"status": failure.status, "code": failure.code, "message": str(failure)},
                }
            )
        print_error(failure)
        return 1
    if args.json:
        emit_json(
            {
                "server": args.server,
                "acknowledged": [{"rollout_id": r, "attempt_index": a} for r, a in acknowledged],
                "outcome": "acknowledged",
            }
        )
    else:
        listed = ", ".join(f"{r}:{a}" for r, a in acknowledged)
        output.console.print(f"{escape(args.server)}: acknowledged {escape(listed)}")
    return 0
