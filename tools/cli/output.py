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

        from quiesce.tools.cli.safe_text import safe_segments

        made = _consoles[name] = Console(stderr=name == "err_console", highlight=False)
        made.push_render_hook(safe_segments())  # the last guard against raw control characters
    return made


def __getattr__(name: str) -> Console:
    """``console``: people-facing output on stdout (rich drops colour when stdout is not a
    terminal); ``err_console``: progress and errors on stderr. Both are made on first use, so a
    command that only prints JSON never imports rich (``quiesce recover --json`` starts faster)."""
    if name in ("console", "err_console"):
        return _console(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def emit_json(document: Any) -> None:
    """Write one JSON document to stdout (a URL's password in it hidden: `mask_url_passwords`)."""
    from quiesce.ledger.redact import mask_url_passwords

    sys.stdout.write(mask_url_passwords(json.dumps(document, indent=2, sort_keys=True, default=str)) + "\n")
    sys.stdout.flush()


def emit_jsonl(rows: Iterable[Any]) -> None:
    """Write each row as one compact JSON object on its own line."""
    from quiesce.ledger.redact import mask_url_passwords
    from quiesce.tools.cli.safe_text import json_text

    encode = json.JSONEncoder(sort_keys=True, ensure_ascii=False, default=str).encode
    sys.stdout.write(json_text(mask_url_passwords("".join(encode(row) + "\n" for row in rows))))
    sys.stdout.flush()


def print_error(error: BaseException | str, *, one_line: bool | None = None) -> None:
    """Print an error message for people: no traceback, the message says what to do. Made safe
    (`safe_text`): on one line when `one_line` (default: for an error that carries servers'
    replies, `carries_replies`), else lines after the first indented."""
    from quiesce.coordinator.wording import plain
    from quiesce.tools.cli.safe_text import MESSAGE_MAX, block_markup, markup

    single = carries_replies(error) if one_line is None else one_line
    text = plain(str(error))
    shown = markup(text, MESSAGE_MAX) if single else block_markup(text)
    _console("err_console").print(f"[bold red]error:[/] {shown}", markup=True, soft_wrap=True)


def carries_replies(error: BaseException | str) -> bool:
    """Whether `error`'s message is one line by nature and quotes servers' replies (a failed
    phase, a refusal naming holders, an acknowledgement refused, an interruption): then a newline
    in it is a server's, printed escaped."""
    from quiesce.coordinator.errors import AcknowledgementError, PhaseError, ServersHeld
    from quiesce.tools.cli.signals import Interrupted

    return isinstance(error, PhaseError | ServersHeld | AcknowledgementError | Interrupted)
