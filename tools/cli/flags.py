"""The flag set every `quiesce` command shares, defined once.

- `--json` (one JSON document on stdout) and `--debug` (tracebacks) are accepted before or after
  the command name: every command's parser takes them from `shared_flags()` — `Commands` adds it
  to each parser a command registers, so a command file never defines them itself.
- `-o table|wide|json|jsonl` (`add_output`) on every command that lists: `--json` is `-o json`;
  `finish` sets `args.output` on every command (`json` or `table` where there is no `-o`) and
  `args.json` true for `-o json`.
- `--config FILE` (`add_config`): the cluster config; `$QUIESCE_CONFIG` is its default.
- `--service URL` (`add_service`, default `$QUIESCE_SERVICE` when no `--config` is given): drive a
  running `quiesce serve` instead of opening the ledger; `--config` is then not needed.
- The ledger of a reading command (`add_ledger`): `--ledger URL|FILE` (a database URL, or the path
  of a SQLite ledger file) or `--config FILE` (its `ledger:`), default `$QUIESCE_CONFIG`; `finish`
  puts the URL into `args.ledger`, so a handler reads only that.

Rules: a bad value is bad usage — exit 2, with the value shown as it was typed (a password in
a URL masked) and what to give instead. Nothing here imports SQLAlchemy, pydantic or rich unless
the value needs them (a config file, a URL other than a plain SQLite one): `quiesce history
--ledger FILE --json` must start fast.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from quiesce.ledger.errors import LedgerError, LedgerUrlError
from quiesce.ledger.urls import SQLITE_PREFIX, plain_sqlite_path

#: The environment variable naming the default cluster config.
CONFIG_ENV: Final = "QUIESCE_CONFIG"
#: The environment variable naming the default `--service URL`.
SERVICE_ENV: Final = "QUIESCE_SERVICE"
#: The output formats of `-o`: `wide` adds columns, `jsonl` is one JSON object per listed row.
OUTPUTS: Final = ("table", "wide", "json", "jsonl")
#: What shell completion offers for a flag naming a file (shtab reads `action.complete`).
FILE_COMPLETION: Final = {"bash": "_shtab_compgen_files", "zsh": "_files", "tcsh": "f"}
_PASSWORD: Final = re.compile(r"(://[^:/@\s]*:)[^@/\s]*@")


class CommandError(Exception):
    """An error a command finds itself: `code` is its stable `--json` code, `exit_code` what the
    command exits with, `fields` what the `--json` error document adds."""

    code: str = "failed"
    exit_code: int = 1

    def __init__(self, message: str, *, code: str | None = None, exit_code: int | None = None, **fields: Any):
        super().__init__(message)
        if code is not None:
            self.code = code
        if exit_code is not None:
            self.exit_code = exit_code
        self.fields = fields


class UsageError(CommandError):
    """Bad usage found after parsing (a missing `--config`, a bad ledger): exit 2."""

    code = "usage"
    exit_code = 2


@functools.cache
def shared_flags() -> argparse.ArgumentParser:
    """The parent parser of every command: `--json` and `--debug`, set only when given (so the
    same flag given before the command name is not overwritten by a default)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document on stdout"
    )
    parent.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors"
    )
    return parent


class Commands:
    """A subparsers action whose every parser takes the shared flags (`shared_flags`).

    A command file that still defines `--json` itself replaces the shared one (conflicts resolve
    to the command's own definition) instead of failing.
    """

    def __init__(self, action: Any) -> None:
        self._action = action

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        kwargs["parents"] = [*kwargs.get("parents", ()), shared_flags()]
        kwargs.setdefault("conflict_handler", "resolve")
        parser: argparse.ArgumentParser = self._action.add_parser(name, **kwargs)
        return parser


def shown(text: str) -> str:
    """`text` as typed, with the password of a `scheme://user:password@host` URL masked."""
    return _PASSWORD.sub(r"\1***@", text)


def ledger_url(text: str, *, must_exist: bool) -> str:
    """The ledger URL of a `--ledger` value: a URL as given, or `sqlite+aiosqlite:///ABSPATH` for
    a file path. Raises `argparse.ArgumentTypeError` (exit 2) naming the value as typed."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty value: give a ledger file path or a database URL")
    if "://" not in text:
        path = Path(text).expanduser()
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a folder: give the ledger's database file")
        if must_exist and not path.is_file():
            raise argparse.ArgumentTypeError(
                f"{text!r}: no such ledger file (give an existing ledger file, or a database URL such"
                " as sqlite+aiosqlite:///PATH or postgresql+asyncpg://USER@HOST/DB)"
            )
        return SQLITE_PREFIX + str(path.resolve())
    plain = plain_sqlite_path(text)
    if plain is None:
        from quiesce.ledger.urls import parse  # SQLAlchemy's URL parser: only for URLs that need it

        try:
            backend, url = parse(text)
        except LedgerUrlError as error:  # says what is wrong with it
            raise argparse.ArgumentTypeError(str(error)) from None
        except (LedgerError, ValueError):  # ValueError: SQLAlchemy on a bad port, for one
            raise argparse.ArgumentTypeError(
                f"{shown(text)!r} is not a ledger URL: use a file path, sqlite+aiosqlite:///PATH or"
                " postgresql+asyncpg://USER@HOST/DB"
            ) from None
        plain = url.database if backend == "sqlite" else None
    if must_exist and plain is not None and not Path(plain).is_file():
        if Path(plain).is_dir():
            raise argparse.ArgumentTypeError(f"{shown(text)!r}: {plain} is a folder, not a ledger file")
        if Path(plain).exists():
            raise argparse.ArgumentTypeError(f"{shown(text)!r}: {plain} is not a regular file")
        raise argparse.ArgumentTypeError(f"{shown(text)!r}: no ledger file {plain}")
    return text


@dataclass(frozen=True)
class _LedgerSource:
    required: bool
    use_env: bool


def add_config(parser: argparse.ArgumentParser) -> None:
    """`--config FILE`, required unless `$QUIESCE_CONFIG` names one (checked by `finish`)."""
    action = parser.add_argument(
        "--config", metavar="FILE", default=None, help=f"cluster config (YAML); default ${CONFIG_ENV}"
    )
    action.complete = FILE_COMPLETION  # type: ignore[attr-defined]  # read by shtab
    parser.set_defaults(_config_required=True)


def add_service(parser: argparse.ArgumentParser) -> None:
    """`--service URL`: drive the `quiesce serve` at URL (`quiesce.tools.serve.client`) instead of
    opening the ledger; default `$QUIESCE_SERVICE` unless `--config` is given. Its API token comes
    from `$QUIESCE_API_TOKEN`, never from the command line (it would show in `ps`)."""
    parser.add_argument(
        "--service",
        metavar="URL",
        default=None,
        help="drive the running `quiesce serve` at URL instead of opening the ledger (no --config needed;"
        f" default ${SERVICE_ENV}; API token from $QUIESCE_API_TOKEN)",
    )


def add_output(parser: argparse.ArgumentParser) -> None:
    """`-o table|wide|json|jsonl`: `wide` adds columns, `json` is `--json`, `jsonl` prints one JSON
    object per listed row (attempt, server, snapshot, ...) on its own line."""
    parser.add_argument(
        "-o",
        "--output",
        metavar="FORMAT",
        choices=OUTPUTS,
        default=None,
        help="table (default), wide (more columns), json (as --json) or jsonl (one JSON object per row)",
    )


def add_ledger(
    parser: argparse.ArgumentParser, *, must_exist: bool = True, required: bool = True, use_env: bool = True
) -> None:
    """`--ledger URL|FILE` or `--config FILE` (its ledger); `finish` sets `args.ledger`.

    `must_exist`: a named file (or SQLite URL) must be an existing file (readers); `required`: one
    of the two (or `$QUIESCE_CONFIG` when `use_env`) must be given.
    """
    where = parser.add_mutually_exclusive_group()
    ledger = where.add_argument(
        "--ledger",
        metavar="URL|FILE",
        type=functools.partial(ledger_url, must_exist=must_exist),
        help="the ledger: a SQLite file path, sqlite+aiosqlite:///PATH or postgresql+asyncpg://USER@HOST/DB",
    )
    config = where.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="a cluster config whose ledger to use" + (f" (default ${CONFIG_ENV})" if use_env else ""),
    )
    ledger.complete = config.complete = FILE_COMPLETION  # type: ignore[attr-defined]  # read by shtab
    parser.set_defaults(_ledger_source=_LedgerSource(required, use_env))


def finish(args: argparse.Namespace) -> None:
    """Apply the defaults that depend on the environment or a config file. Raises `UsageError`
    (exit 2) when a required `--config` or ledger is missing; a bad config file raises
    `ConfigError` (exit 2 as well)."""
    args.debug = getattr(args, "debug", False)
    args.output = output_of(args)
    args.json = args.output == "json"
    source: _LedgerSource | None = getattr(args, "_ledger_source", None)
    if "service" in args:
        if args.service is not None and args.config is not None:
            raise UsageError(
                "--service URL drives a running `quiesce serve` (it has its config): drop --config"
            )
        if args.service is None and args.config is None:
            args.service = os.environ.get(SERVICE_ENV) or None
        if args.service is not None:
            args.service = service_url(args.service)
            return  # the service has the config and the ledger
    if getattr(args, "_config_required", False) and args.config is None:
        args.config = os.environ.get(CONFIG_ENV) or None
        if args.config is None:
            raise UsageError(f"--config FILE is required (or set {CONFIG_ENV} to the cluster config)")
    if source is not None and args.ledger is None:
        config = args.config or (os.environ.get(CONFIG_ENV) or None if source.use_env else None)
        if config is not None:
            from quiesce.coordinator.config import load_config  # pydantic + YAML: only when a config is named

            args.config = config
            args.ledger = load_config(config).ledger
        elif source.required:
            raise UsageError(f"name the ledger: --ledger URL|FILE, or --config FILE (or set {CONFIG_ENV})")


def output_of(args: argparse.Namespace) -> str:
    """The output format asked for: `-o` (where the command has it), `--json` (= `-o json`),
    else `table`. `--json` with another `-o` is bad usage."""
    chosen: str | None = getattr(args, "output", None)
    if getattr(args, "json", False):
        if chosen not in (None, "json"):
            raise UsageError(f"--json is -o json: give either --json or -o {chosen}, not both")
        return "json"
    return chosen or "table"


def wants_json(argv: Sequence[str]) -> str | None:
    """`json` or `jsonl` when `argv` asks for a JSON output (`--json`, `-o json[l]`), else None:
    what an error found while parsing is printed as."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--json":
            return "json"
        value = None
        if arg in ("-o", "--output") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--output="):
            value = arg.removeprefix("--output=")
        elif arg.startswith("-o") and not arg.startswith("--"):
            value = arg[2:].removeprefix("=")
        if value in ("json", "jsonl"):
            return value
    return None


def service_url(text: str) -> str:
    """A `--service` value as a base URL: `http(s)://HOST[:PORT]`, no trailing slash."""
    url = text.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise UsageError(f"--service {shown(text)!r}: give the service's address, e.g. http://127.0.0.1:8470")
    return url


def out_file(path: Path, *, flag: str = "--out") -> Path:
    """`path` as a file to write: its folder must exist (quiesce never creates it) and it must not
    be a folder. Raises `UsageError` naming the flag otherwise."""
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(
            f"{flag} {path}: the folder {folder} does not exist; create it or choose another path"
        )
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    return path


def seconds(text: str) -> float:
    """argparse type of a budget in seconds: a finite number above 0 (the upper bound is the
    config's `max_deadline_s`, checked once the config is read)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a budget must be more than 0 seconds")
    return value
