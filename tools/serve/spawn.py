"""Start `quiesce serve` as a child process and wait for the address it announces.

Rule: the child is `python -m quiesce serve --config C --listen 127.0.0.1:0 --json` run from the
repository root, so it runs this tree's code; it is returned only once it has printed its one
JSON line (`{"listening": URL, ...}`) on stdout. A child that exits or stays silent for
`startup_s` is killed and `ServiceDidNotStart` carries its stderr (written to `log`). The caller
owns the process from then on (stop it with SIGTERM). Used by the service tests and the bench.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from quiesce.tools.gymsim.cluster import IMPORT_ROOT

__all__ = ["ServiceDidNotStart", "start_service"]

_LISTEN = ("--listen", "127.0.0.1:0", "--json")


class ServiceDidNotStart(RuntimeError):
    """The child exited or announced nothing in time; the message holds its stderr."""


def start_service(
    config: Path,
    env: Mapping[str, str],
    log: Path,
    *,
    extra: Sequence[str] = (),
    startup_s: float = 60.0,
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """The started child and the JSON line it announced (see the module docstring)."""
    with open(log, "w", encoding="utf-8") as errors:
        process = subprocess.Popen(
            [sys.executable, "-m", "quiesce", "serve", "--config", str(config), *_LISTEN, *extra],
            cwd=str(IMPORT_ROOT),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
    assert process.stdout is not None
    line = _first_line(process.stdout, startup_s)
    if not line:
        process.kill()
        process.wait()
        raise ServiceDidNotStart(f"quiesce serve did not start:\n{log.read_text(errors='replace')}")
    announced: dict[str, Any] = json.loads(line)
    return process, announced


def _first_line(stream: IO[str], timeout_s: float) -> str | None:
    """The stream's first line, or None after `timeout_s` (a hang guard for a silent child)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        return None
