"""Shared pieces of the commands that drive a cluster (discover, checkpoint, restore, resume, abort).

- `add_common(parser)`: `--config FILE` (default `$QUIESCE_CONFIG`; `--json` and `--debug` come with
  every command, `tools/cli/flags.py`).
- `driving(args, config, ...)`: what a command drives the cluster through — the running
  `quiesce serve` at `--service URL` (`RemoteCoordinator`: no ledger opened here, the same
  results and errors), else a `Coordinator` opened on the config's ledger. Both are a `Driver`.
- `frees(args)`: how the user reaches the same coordinator in a next command (`--service URL` or
  `--config FILE`).
- `progress_line()`: the coordinator's progress shown on stderr (`tools/cli/progress.py`).
- `phase_error_json(error)`: the `error` object of the `--json` documents.
- `print_resubmit(resubmit)`: after a restore, or the resume of one, one `send again: rollout X as
  attempt N on AGENT` line per execution the caller must send `/run` for again (Gym's restore runs
  none of them by itself); on the unified plane `start: rollout X attempt N on SERVER`.
- `print_continuations(restart, unknown)`: after a v1 restore, or the resume of one, one `start
  afresh: ...` line per continuation discarded (its `/run` starts from the task) and one
  `resubmissions unknown on AGENT: REASON` line per agent whose folder does not say what to send.
- `require_unified(found, what)`: a flag or command of Gym's unified plane asked of a v1 cluster is
  bad usage (exit 2), refused before anything is sent.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from quiesce.coordinator import (
    Attempt,
    ClusterConfig,
    Coordinator,
    Discovery,
    EpisodeId,
    Outcome,
    PhaseError,
    Resubmission,
    RetireOutcome,
    UnknownResubmissions,
    load_config,
)
from quiesce.tools.cli import output
from quiesce.tools.cli.flags import UsageError, add_config, add_service
from quiesce.tools.cli.output import emit_json, print_error
from quiesce.tools.cli.progress import progress_line

if TYPE_CHECKING:
    from quiesce.coordinator.status import ClusterStatus

#: How long a command through `--service` keeps trying to reach a service (or the active one of
#: a standby pair) before it reports it unreachable.
SERVICE_FAILOVER_S = 5.0

__all__ = [
    "Driver",
    "add_common",
    "driving",
    "escape",
    "frees",
    "phase_error_json",
    "print_continuations",
    "print_restored_again",
    "print_resubmit",
    "print_warnings",
    "progress_line",
    "require_unified",
    "run_outcome",
]


def escape(text: str) -> str:
    """Outside text made safe for a rich markup line (`safe_text.escape`: control characters
    escaped, length capped, markup escaped), loading rich only once something is printed."""
    from quiesce.tools.cli.safe_text import escape as safe_escape

    return safe_escape(text)


def add_common(parser: argparse.ArgumentParser, *, service: bool = False) -> None:
    """`--config FILE`; with `service`, `--service URL` too (`flags.add_service`)."""
    add_config(parser)
    if service:
        add_service(parser)


class Driver(Protocol):
    """What the cluster commands call: `Coordinator`'s methods, which `RemoteCoordinator` mirrors."""

    def discover(self) -> Awaitable[Discovery]: ...

    def checkpoint(
        self,
        *,
        deadline_s: float | None = None,
        episodes: Sequence[EpisodeId] | None = None,
        stop: bool = False,
        into: str | os.PathLike[str] | None = None,
    ) -> Awaitable[Attempt]: ...

    def restore(
        self,
        snapshot: str | os.PathLike[str] | None = None,
        *,
        deadline_s: float | None = None,
        resume: bool = False,
    ) -> Awaitable[Attempt]: ...

    def resume(self, target: Attempt | str | None = None) -> Awaitable[Outcome]: ...

    def abort(self, target: Attempt | str | None = None, *, reason: str = ...) -> Awaitable[Outcome]: ...

    def acknowledge_completed(
        self, server: str, executions: Sequence[tuple[str, int]]
    ) -> Awaitable[list[tuple[str, int]]]: ...

    def status(self) -> Awaitable[ClusterStatus]: ...

    def retire(
        self, episodes: Sequence[EpisodeId], *, deadline_s: float | None = None
    ) -> Awaitable[RetireOutcome]: ...

    def forget(
        self, rollout_ids: Sequence[str], *, deadline_s: float | None = None
    ) -> Awaitable[RetireOutcome]: ...


def config_of(args: argparse.Namespace) -> ClusterConfig | None:
    """The cluster config, or None through `--service` (the service has its own)."""
    return None if getattr(args, "service", None) else load_config(args.config)


@asynccontextmanager
async def driving(
    args: argparse.Namespace, config: ClusterConfig | None, **opened: Any
) -> AsyncIterator[Driver]:
    """The service at `args.service`, else a `Coordinator` opened on `config` with `opened`."""
    if config is None:
        from quiesce.tools.serve.client import RemoteCoordinator  # httpx: only for --service

        async with RemoteCoordinator(args.service, failover_s=SERVICE_FAILOVER_S) as remote:
            yield remote
        return
    async with Coordinator.open(config, config_path=args.config, **opened) as coord:
        yield coord


def frees(args: argparse.Namespace) -> str:
    """The flag that reaches this coordinator again in a next command."""
    service = getattr(args, "service", None)
    return f"--service {service}" if service else f"--config {args.config}"


def require_unified(found: Discovery, what: str) -> None:
    """`UsageError` (exit 2, nothing sent) when `what` — a flag or command of Gym's unified plane —
    is asked of a cluster that speaks control plane v1."""
    if found.plane != "v2":
        raise UsageError(
            f"{what} is part of Gym's unified checkpoint plane (/ng-control/v1/checkpoint/*), and this"
            " cluster's servers speak control plane v1; leave it out, or point the config at servers"
            " of current Gym",
            code="plane",
        )


def phase_error_json(error: PhaseError) -> dict[str, Any]:
    """The `error` object of a failed phase (`warnings` when the attempt began with some, e.g. a
    restore of a snapshot this ledger did not publish)."""
    document: dict[str, Any] = {
        "phase": error.phase,
        "server": error.server,
        "code": error.code,
        "message": str(error),
    }
    if error.warnings:
        document["warnings"] = list(error.warnings)
    return document


def print_resubmit(resubmit: Sequence[Resubmission], indent: str = "", *, plane: str = "v1") -> None:
    """One line per execution a restore continues but does not run: the caller sends it again (v1:
    `send again: rollout X as attempt N on AGENT`; the unified plane: `start: rollout X attempt N on
    SERVER`, the replacement attempt the trainer starts there)."""
    for r in resubmit:
        line = (
            f"start: rollout {r.rollout_id} attempt {r.attempt_index} on {r.server}"
            if plane == "v2"
            else f"send again: rollout {r.rollout_id} as attempt {r.attempt_index} on {r.server}"
        )
        output.console.print(escape(indent + line), soft_wrap=True)


def print_continuations(
    restart: Sequence[Resubmission], unknown: Sequence[UnknownResubmissions], indent: str = ""
) -> None:
    """What a v1 restore leaves to the caller beside `print_resubmit`: each execution whose saved
    turn was discarded (it depended on a `restart_only` resources server) — its `/run` starts from
    the task —, then each agent whose resubmissions are unknown, with the reason."""
    for r in restart:
        line = (
            f"start afresh: rollout {r.rollout_id} as attempt {r.attempt_index} on {r.server}"
            " (its saved turn depended on a restart_only resources server and was discarded)"
        )
        output.console.print(escape(indent + line), soft_wrap=True)
    for u in unknown:
        line = (
            f"resubmissions unknown on {u.server}: {u.reason}. Its state was restored; ask the agent"
            " (or your own records) which executions to send again"
        )
        output.console.print(escape(indent + line), soft_wrap=True)


def print_restored_again(names: Sequence[str], indent: str = "") -> None:
    """The servers a restore's resume found restarted since the restore, and restored again first."""
    if names:
        output.console.print(
            escape(
                f"{indent}restored again before the resume (restarted since the restore, they held"
                f" none of its state): {', '.join(names)}"
            ),
            soft_wrap=True,
        )


def print_warnings(warnings: tuple[str, ...] | list[str]) -> None:
    for warning in warnings:
        output.err_console.print(f"[bold yellow]warning:[/] {escape(warning)}", soft_wrap=True)


def register_outcome(subparsers: Any, what: str, *, help: str, description: str) -> None:
    """The parser of `quiesce resume [ID]` / `quiesce abort [ID]` (`what`), handled by `run_outcome`."""
    parser: argparse.ArgumentParser = subparsers.add_parser(what, help=help, description=description)
    parser.add_argument(
        "checkpoint_id",
        metavar="ID",
        nargs="?",
        help="the checkpoint id to act on (default: whatever holds the servers, asked now)",
    )
    add_common(parser, service=True)
    parser.set_defaults(handler=lambda args: run_outcome(args, what))


def run_outcome(args: argparse.Namespace, what: str) -> int:
    """`quiesce resume [ID]` / `quiesce abort [ID]`: act on the given checkpoint id, or on whatever
    holds the servers (the coordinator asks them); print the outcome."""
    config = config_of(args)
    target: str | None = args.checkpoint_id
    result: Outcome | None = None
    failure: PhaseError | None = None

    async def run() -> None:
        nonlocal result, failure
        with progress_line() as progress:
            # no automatic recovery first: resume/abort act on the paused attempt themselves
            async with driving(args, config, on_progress=progress, recover=False) as coord:
                try:
                    result = await (coord.resume(target) if what == "resume" else coord.abort(target))
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
            f"nothing to do: no server is held by {escape(target)}"
            if target
            else "nothing to do: no server is held"
        )
    else:
        for one in (result, *result.also):
            output.console.print(
                f"{escape(one.checkpoint_id or '')}: {one.outcome} —"
                f" {escape(', '.join(one.servers) or 'no server')}"
            )
            print_restored_again(one.restored_again)
            print_resubmit(one.resubmit)
            print_continuations(one.restart, one.resubmit_unknown)
    if result.left_paused:
        print_error(
            f"could not resume {', '.join(result.left_paused)};"
            f" run `quiesce resume {frees(args)}` again once they are reachable"
        )
        return 1
    return 0
