"""Output rules shared by every command.

Machine-readable output (`--json`) goes to stdout as one JSON document; everything
for people goes through rich. Colours and progress only when the stream is a terminal.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape

#: People-facing output on stdout; rich drops colour when stdout is not a terminal.
console = Console(highlight=False)
#: Progress and errors on stderr.
err_console = Console(stderr=True, highlight=False)


def emit_json(document: Any) -> None:
    """Write one JSON document to stdout."""
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def print_error(error: BaseException | str) -> None:
    """Print an error message for people: no traceback, the message says what to do."""
    err_console.print(f"[bold red]error:[/] {escape(str(error))}", markup=True, soft_wrap=True)
