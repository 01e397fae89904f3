"""`quiesce checkpoint --config C | --service URL [--deadline-s N] [--episodes FILE|-] [--stop]
[--into FOLDER] [--json]`
— prepare → commit → publish → resume.

Prints the published snapshot: one line `published ID -> PATH` on stdout (progress is on stderr),
so a script can read it from a pipe. `--service URL` drives a running `quiesce serve` instead of
opening the ledger (which that service holds). On failure the attempt is rolled back (every touched server
resumed) and the command exits 1, naming the phase, the server, the reason, who was resumed,
who could not be, and the latest snapshot still in place. While a participant is held by another
checkpoint id (a restore waiting for its resume, an attempt a dead coordinator left) nothing is
sent: it exits 1 naming the holder, its kind, since when and the command that frees it.

Gym's unified plane (v2) only — asked of a v1 cluster, either flag is bad usage (exit 2, nothing sent):
- `--episodes FILE|-`: the commit scope, the episodes the trainer continues (JSON lines,
  `tools/cli/episodes.py`; a bad line is exit 2 naming it, before anything is sent). Without it the
  scope is what the environment servers export.
- `--stop`: a stop-checkpoint — published, then the servers stay paused for shutdown; the way on is
  a restore into freshly started servers.
- `--into FOLDER`: commit into FOLDER (the trainer's own snapshot folder, which it publishes itself)
  and publish there in place, not into the config's snapshots folder (`Coordinator.save(into=...)`);
  through `--service` the folder is the service host's.
On v2 the outcome adds the scope's size, the restarts left out of it (the trainer starts them over)
and what each server exported — on stdout under a terminal, on stderr when stdout is a pipe (which
keeps its one line).

`--json` prints `{"checkpoint_id", "outcome": "published"|"aborted"|"refused", "snapshot",
"participants", "skipped", "plane", "scope", "restarts", "exported", "stop", "error"?, "resumed"?,
"not_resumed"?, "held"?}` (`scope`: capture keys; `restarts` / `exported`: server → capture keys).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, Final

import anyio

from quiesce.coordinator import Attempt, Coordinator, Discovery, EpisodeId, PhaseError, ServersHeld
from quiesce.coordinator.config import check_deadline
from quiesce.coordinator.wording import count
from quiesce.tools.cli import output
from quiesce.tools.cli.cluster_cmd import (
    add_common,
    config_of,
    driving,
    escape,
    frees,
    phase_error_json,
    print_warnings,
    progress_line,
    require_unified,
)
from quiesce.tools.cli.episodes import FILE_HELP, read_episodes
from quiesce.tools.cli.flags import FILE_COMPLETION, seconds
from quiesce.tools.cli.output import emit_json, print_error
from quiesce.tools.cli.signals import SignalStop, abandoned, interrupted, past_the_point, records_since

if TYPE_CHECKING:
    from quiesce.ledger import Event

#: Capture keys named in a line of the outcome (the rest are counted).
NAMED: Final = 10


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
    episodes = parser.add_argument(
        "--episodes",
        metavar="FILE|-",
        default=None,
        help="unified plane: the episodes the trainer continues (the commit scope); " + FILE_HELP,
    )
    episodes.complete = FILE_COMPLETION  # type: ignore[attr-defined]  # read by shtab
    parser.add_argument(
        "--stop",
        action="store_true",
        help="unified plane: a stop-checkpoint — publish, then leave the servers paused for shutdown"
        " (restore into freshly started servers to go on)",
    )
    into = parser.add_argument(
        "--into",
        metavar="FOLDER",
        default=None,
        help="unified plane: commit into FOLDER (e.g. the trainer's own snapshot folder) and publish there"
        " in place, instead of the snapshots folder; only the servers' folders in it are the snapshot's",
    )
    into.complete = FILE_COMPLETION  # type: ignore[attr-defined]  # read by shtab
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    config = config_of(args)
    if config is not None:
        check_deadline(config, args.deadline_s, what="--deadline-s")  # exit 2 before the ledger is opened
    # a bad line is exit 2 before the ledger is opened or anything is sent
    scope: list[EpisodeId] | None = read_episodes(args.episodes) if args.episodes is not None else None
    found: Discovery | None = None
    attempt: Attempt | None = None
    failure: PhaseError | None = None
    refused: ServersHeld | None = None

    stop = SignalStop()
    records: list[Event] = []

    async def run() -> None:
        nonlocal found, attempt, failure, refused
        async with stop.watching():
            with progress_line() as progress:
                async with driving(args, config, on_progress=progress) as coord:
                    local = coord if isinstance(coord, Coordinator) else None
                    after = await local.ledger.last_seq() if local is not None else 0
                    with stop.operation(lambda: past_the_point(local.current if local else None)):
                        found = await coord.discover()
                        print_warnings(found.warnings)
                        if scope is not None:
                            require_unified(found, "--episodes")
                        if args.stop:
                            require_unified(found, "--stop")
                        if args.into is not None:
                            require_unified(found, "--into")
                        try:
                            attempt = await coord.checkpoint(
                                deadline_s=args.deadline_s, episodes=scope, stop=args.stop, into=args.into
                            )
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
                    **_unified(None, found, stop=args.stop),
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
        **_unified(attempt, found, stop=args.stop),
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
            output.console.print(escape(line), soft_wrap=True)
        else:  # a pipe: exactly this one line, never wrapped
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        if attempt is not None and found.plane == "v2":
            _print_unified(attempt, args)
    if failure is not None:
        print_error(failure)
        return 1
    return 0


def _unified(attempt: Attempt | None, found: Discovery, *, stop: bool) -> dict[str, Any]:
    """The `--json` fields of the unified plane (empty scope and maps on v1, or before a commit)."""
    return {
        "plane": found.plane,
        "scope": list(attempt.scope) if attempt is not None else [],
        "restarts": {s: list(k) for s, k in attempt.restarts.items()} if attempt is not None else {},
        "exported": {s: list(k) for s, k in attempt.exported.items()} if attempt is not None else {},
        "stop": attempt.stop if attempt is not None else stop,
    }


def _named(keys: list[str] | tuple[str, ...]) -> str:
    shown = ", ".join(keys[:NAMED])
    return shown + (f" and {len(keys) - NAMED} more" if len(keys) > NAMED else "")


def _print_unified(attempt: Attempt, args: argparse.Namespace) -> None:
    """What a unified-plane save covered: on stdout under a terminal, else on stderr (the pipe keeps
    its one `published` line)."""
    out = output.console if sys.stdout.isatty() else output.err_console
    lines = [
        f"scope: {count(len(attempt.scope), 'episode')}"
        + (f" ({_named(attempt.scope)})" if attempt.scope else "")
    ]
    restarts = sorted({key for keys in attempt.restarts.values() for key in keys})
    if restarts:
        where = ", ".join(f"{server}: {len(keys)}" for server, keys in attempt.restarts.items() if keys)
        lines.append(f"left out as restarts ({where}): {_named(restarts)} — the trainer starts them over")
    else:
        lines.append("restarts: none")
    exported = ", ".join(f"{server} {len(keys)}" for server, keys in attempt.exported.items())
    lines.append(f"exported: {exported or 'nothing'}")
    if attempt.stop:
        lines.append(
            "stop: the servers stay paused for shutdown (resuming would run them on); to go on, restore"
            f" this snapshot into freshly started servers: quiesce restore {frees(args)} --snapshot"
            f" {attempt.checkpoint_id}"
        )
    for line in lines:
        out.print(escape(line), soft_wrap=True)
