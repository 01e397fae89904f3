"""Shared pieces of the commands that drive a cluster (discover, checkpoint, restore, resume, abort).

- `add_common(parser)`: `--config FILE` (required) and `--json`.
- `ProgressLine`: a rich status line on stderr — only when stderr is a terminal — fed by the
  coordinator's progress callback (phase, server, in-flight count while draining).
- `phase_error_json(error)`: the `error` object of the `--json` documents.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import anyio

from coordinator import Coordinator, Outcome, PhaseError, Progress, load_config
from tools.cli import output
from tools.cli.output import emit_json, print_error

if TYPE_CHECKING:
    from rich.status import Status


def escape(text: str) -> str:
    """rich markup escaping, loading rich only once something is printed for people."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", required=True, help="cluster config (YAML)")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")


class ProgressLine:
    """Turns coordinator `Progress` reports into one updating line on stderr (terminal only)."""

    def __init__(self, status: Status | None) -> None:
        self._status = status

    def __call__(self, report: Progress) -> None:
        if self._status is None:
            return
        text = f"{report.checkpoint_id} {report.phase}"
        if report.server:
            text += f" · {report.server}"
        if report.inflight is not None:
            text += f" · draining, {report.inflight} in flight"
        self._status.update(escape(text))


@contextmanager
def progress_line(enabled: bool = True) -> Iterator[ProgressLine]:
    """A `ProgressLine` shown while the block runs (silent when stderr is not a terminal)."""
    if not enabled or not output.err_console.is_terminal:
        yield ProgressLine(None)
        return
    with output.err_console.status("starting…") as status:
        yield ProgressLine(status)


def phase_error_json(error: PhaseError) -> dict[str, Any]:
    return {"phase": error.phase, "server": error.server, "code": error.code, "message": str(error)}


def print_warnings(warnings: tuple[str, ...] | list[str]) -> None:
    for warning in warnings:
        output.err_console.print(f"[bold yellow]warning:[/] {escape(warning)}", soft_wrap=True)


def run_outcome(args: argparse.Namespace, what: str) -> int:
    """`quiesce resume` / `quiesce abort`: act on what the ledger says, print the outcome."""
    config = load_config(args.config)
    result: Outcome | None = None
    failure: PhaseError | None = None

    async def run() -> None:
        nonlocal result, failure
        with progress_line(not args.json) as progress:
            # no automatic recovery first: resume/abort act on the paused attempt themselves
            async with Coordinator.open(config, on_progress=progress, recover=False) as coord:
                try:
                    result = await (coord.resume() if what == "resume" else coord.abort())
                except PhaseError as error:
                    failure = error

    anyio.run(run)
    if failure is not None:
        if args.json:
            emit_json(
                {
                    "checkpoint_id": failure.checkpoint_id,
                    "outcome": "failed",
                    "servers": failure.resumed + failure.not_resumed,
                    "error": phase_error_json(failure),
                }
            )
        print_error(failure)
        return 1
    assert result is not None
    if args.json:
        emit_json(result.as_json())
    elif result.outcome == "none":
        output.console.print(
            "nothing to do: no server was left paused" if what == "resume" else "no attempt in progress"
        )
    else:
        output.console.print(
            f"{escape(result.checkpoint_id or '')}: {result.outcome} —"
            f" {escape(', '.join(result.servers) or 'no server')}"
        )
    if result.left_paused:
        print_error(
            f"could not resume {', '.join(result.left_paused)};"
            " run `quiesce resume` again once they are reachable"
        )
        return 1
    return 0
