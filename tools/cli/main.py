"""The `quiesce` command line.

Each file in `tools/cli/commands/` is one command (or one group of commands) and
exposes `register(subparsers)`, which adds its parser and sets `handler` to a
function taking the parsed namespace and returning the exit code. This file only
dispatches and reports errors (`tools/cli/errors.py`: one table from error class to `--json` code
and exit code):

- 0 success; 1 the operation failed; 2 bad usage, bad config, or discovery refused; 130 interrupted
  (Ctrl-C); a `checkpoint` or `restore` stopped by SIGTERM or SIGHUP 128 + its number (143, 129),
  once its attempt was rolled back or finished (`tools/cli/signals.py`).
- An error is one line on stderr (no traceback unless `--debug`), or with `--json` / `-o json|jsonl`
  one JSON document on stdout — argparse's own usage errors too.
- A mistyped command (or choice) is answered with the nearest one: `did you mean 'history'?`.
- A ledger held by a running `quiesce serve` is named with the `--service URL` way to reach it
  (`tools/cli/holder.py`).

The flags every command shares (`--json`, `--debug`, `--config`, `--ledger`, `-o`, `--service`) are
defined once, in `tools/cli/flags.py`: every parser a command registers takes them (`flags.Commands`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import pkgutil
import re
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn, cast

from quiesce.coordinator.errors import FencedError, QuiesceError
from quiesce.coordinator.version import VERSION
from quiesce.tools.cli import commands, flags
from quiesce.tools.cli.errors import ErrorReport, emit, exit_code_for

__all__ = ["Parser", "build_parser", "exit_code_for", "main"]

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


_INVALID_CHOICE = re.compile(
    r"argument (?P<arg>.+?): invalid choice: '(?P<value>.*)' \(choose from (?P<choices>.*)\)$"
)


def did_you_mean(message: str) -> str:
    """argparse's `invalid choice` message as `unknown command 'X'; did you mean 'Y'?` (or the
    choices, when none is near); any other message as it is."""
    found = _INVALID_CHOICE.match(message)
    if found is None:
        return message
    value = found["value"]
    choices = [c.strip().strip("'") for c in found["choices"].split(",")]
    near = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    what = "command" if found["arg"] in ("COMMAND", "SUBCOMMAND") else f"value for {found['arg']}"
    hint = f"did you mean '{near[0]}'?" if near else "choose from " + ", ".join(choices)
    return f"unknown {what} '{value}'; {hint}"


class Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors follow the CLI's rules: `did_you_mean`, and one JSON
    document on stdout when the command line asks for JSON output (`flags.wants_json`). Exit 2."""

    def error(self, message: str) -> NoReturn:
        from quiesce.tools.cli.safe_text import one_line

        message = did_you_mean(message)
        output = flags.wants_json(sys.argv[1:] if _ARGV is None else _ARGV)
        if output is not None:
            emit(ErrorReport("usage", 2, message, {"usage": self.format_usage().strip()}), output)
        elif message.startswith("unknown command"):
            sys.stderr.write(f"error: {one_line(message)}\n(run `{self.prog} --help` for the commands)\n")
        else:  # the message may quote the command line: made safe for the terminal
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {one_line(message)}\n")
        sys.exit(2)


#: The argv `main` parses (None: `sys.argv[1:]`), for `Parser.error`.
_ARGV: Sequence[str] | None = None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = Parser(
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


def main(argv: Sequence[str] | None = None) -> int:
    global _ARGV
    _ARGV = argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    handler = cast("Handler | None", getattr(args, "handler", None))
    asked = flags.wants_json(sys.argv[1:] if argv is None else argv)
    if handler is None:
        if asked is not None:
            return emit(ErrorReport("usage", 2, "name a command (quiesce --help lists them)"), asked)
        parser.print_help(sys.stderr)
        return 2
    try:
        flags.finish(args)
        return handler(args)
    except flags.CommandError as error:
        return emit(error, _output(args, asked))
    except (QuiesceError, OSError, KeyboardInterrupt) as error:
        if getattr(args, "debug", False):
            raise
        if isinstance(error, FencedError):
            from quiesce.tools.cli.holder import name_the_service

            error = name_the_service(error, args, sys.argv[1:] if argv is None else argv)
        return emit(error, _output(args, asked))


def _output(args: argparse.Namespace, asked: str | None) -> str | None:
    """The output an error is reported in: JSON when the command line asked for it anywhere
    (`--json`, `-o json|jsonl`), else the command's."""
    chosen = getattr(args, "output", None)
    return asked if asked is not None or chosen is None else str(chosen)


if __name__ == "__main__":
    raise SystemExit(main())
