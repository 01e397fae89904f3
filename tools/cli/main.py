"""The `quiesce` command line.

Each file in `tools/cli/commands/` is one command (or one group of commands) and
exposes `register(subparsers)`, which adds its parser and sets `handler` to a
function taking the parsed namespace and returning the exit code. This file only
dispatches and maps errors to exit codes:

- 0 success; 1 the operation failed; 2 bad usage, bad config, or discovery refused.
- A `QuiesceError` prints its message (no traceback unless `--debug`); so does an `OSError` that
  reaches here (a file that cannot be written, a full disk): its message names the file.

The flags every command shares (`--json`, `--debug`, `--config`, `--ledger`) are defined once, in
`tools/cli/flags.py`: every parser a command registers takes them (`flags.Commands`).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Callable, Sequence
from typing import cast

from quiesce.coordinator.errors import ConfigError, DiscoveryError, MissingExtra, QuiesceError
from quiesce.coordinator.version import VERSION
from quiesce.tools.cli import commands, flags

Handler = Callable[[argparse.Namespace], int]


def _command_modules(argv: Sequence[str]) -> list[str]:
    """The command modules to import: only the one named on the command line when it exists
    (`verify-bundle` → `verify_bundle`), else all of them (for `--help` and usage errors).
    Importing one keeps start-up cheap: `quiesce history` must not load httpx or FastAPI."""
    first = next((a for a in argv if not a.startswith("-")), None)
    if first is None and "--version" in argv:
        return []  # `quiesce --version` needs no command
    names = sorted(m.name for m in pkgutil.iter_modules(commands.__path__))
    if first is not None and first.replace("-", "_") in names:
        return [first.replace("-", "_")]
    return names


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quiesce",
        description="Checkpoint coordinator for NeMo Gym servers (control plane v1).",
    )
    parser.add_argument("--version", action="version", version=f"quiesce {VERSION}")
    parser.add_argument(
        "--debug", action="store_true", help="show tracebacks on errors (here or after COMMAND)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    sub = flags.Commands(parser.add_subparsers(dest="command", metavar="COMMAND"))
    for name in _command_modules(sys.argv[1:] if argv is None else argv):
        module = importlib.import_module(f"{commands.__name__}.{name}")
        module.register(sub)
    return parser


def exit_code_for(error: QuiesceError) -> int:
    """Usage, config, a missing extra and refused-setup errors are 2; every other failure is 1."""
    return 2 if isinstance(error, ConfigError | DiscoveryError | MissingExtra) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    handler = cast("Handler | None", getattr(args, "handler", None))
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        flags.finish(args)
        return handler(args)
    except flags.UsageError as error:
        _print_error(error)
        return 2
    except QuiesceError as error:
        if args.debug:
            raise
        _print_error(error)
        return exit_code_for(error)
    except OSError as error:
        if args.debug:
            raise
        _print_error(_describe_os_error(error))
        return 1
    except KeyboardInterrupt:
        if args.debug:
            raise
        _print_error("interrupted")
        return 130


def _describe_os_error(error: OSError) -> str:
    where = " -> ".join(str(f) for f in (error.filename, error.filename2) if f is not None)
    what = error.strerror or str(error)
    return f"{what}: {where}" if where else what


def _print_error(error: BaseException | str) -> None:
    from quiesce.tools.cli.output import print_error  # rich: loaded only when there is something to say

    print_error(error)


if __name__ == "__main__":
    raise SystemExit(main())
