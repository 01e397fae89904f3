"""Output rules shared by every command.

Machine-readable output goes to stdout: `--json` (`-o json`) one JSON document, `-o jsonl` one
JSON object per listed row, each on its own line. Everything for people goes through rich; an error
for people is one `error: ...` line on stderr in plain words (`wording.plain`). Colours and
progress only when the stream is a terminal.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

_consoles: dict[str, Console] = {}


def _console(name: str) -> Console:
    made = _consoles.get(name)
    if made is None:
        from rich.console import Console  # rich: loaded by the first line printed for people

        made = _consoles[name] = Console(stderr=name == "err_console", highlight=False)
    return made


def __getattr__(name: str) -> Console:
    """``console``: people-facing output on stdout (rich drops colour when stdout is not a
    terminal); ``err_console``: progress and errors on stderr. Both are made on first use, so a
    command that only prints JSON never imports rich (``quiesce recover --json`` starts faster)."""
    if name in ("console", "err_console"):
        return _console(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def emit_json(document: Any) -> None:
    """Write one JSON document to stdout."""
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def emit_jsonl(rows: Iterable[Any]) -> None:
    """Write each row as one compact JSON object on its own line."""
    encode = json.JSONEncoder(sort_keys=True, ensure_ascii=False, default=str).encode
    sys.stdout.write("".join(encode(row) + "\n" for row in rows))
    sys.stdout.flush()


def print_error(error: BaseException | str) -> None:
    """Print an error message for people: no traceback, the message says what to do."""
    from rich.markup import escape

    from quiesce.coordinator.wording import plain

    _console("err_console").print(
        f"[bold red]error:[/] {escape(plain(str(error)))}", markup=True, soft_wrap=True
    )
