"""Running the command line as an operator does: `python -m quiesce.tools.cli.main ...` in a real process.

`quiesce(*argv, cwd=..., env=..., stdin=...)` runs this tree's CLI (its root first on `PYTHONPATH`, the
caller's `QUIESCE_CONFIG` removed) in `cwd` and returns the finished process, output as text.
`on_terminal(*argv, columns=..., typed=...)` runs it with stdin and stdout on a real terminal
(a pseudo-terminal of that width), stderr piped, `typed` written to the terminal as keystrokes.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment (without a `QUIESCE_CONFIG` of the caller's), `extra`, this tree first."""
    env = {k: v for k, v in os.environ.items() if k != "QUIESCE_CONFIG"}
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "quiesce.tools.cli.main", *argv]


def quiesce(
    *argv: str,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = 240,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `quiesce ARGV` as a real process in `cwd` (`stdin`: text given on its standard input;
    None: an empty one)."""
    return subprocess.run(
        command(*argv),
        cwd=cwd,
        env=child_env(env),
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def json_of(done: subprocess.CompletedProcess[str]) -> Any:
    """The one JSON document a `--json` run printed on stdout."""
    assert done.stdout.strip(), done.stderr
    return json.loads(done.stdout)


def on_terminal(
    *argv: str,
    cwd: Path,
    columns: int,
    env: Mapping[str, str] | None = None,
    typed: str = "",
    timeout: float = 240,
) -> subprocess.CompletedProcess[str]:
    """Run `quiesce ARGV` with stdin and stdout on a pseudo-terminal `columns` wide (`COLUMNS` set
    too), stderr piped; `typed` is sent as input. Returns the process with the terminal's output
    (line ends as `\\n`) as stdout."""
    main, child = os.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    wide = {"COLUMNS": str(columns), "LINES": "50", "TERM": "xterm", **(env or {})}
    process = subprocess.Popen(
        command(*argv), cwd=cwd, env=child_env(wide), stdin=child, stdout=child, stderr=subprocess.PIPE
    )
    os.close(child)
    if typed:
        os.write(main, typed.encode())
    chunks: list[bytes] = []
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        ready, _, _ = select.select([main], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the child closed the terminal (Linux: EIO)
                break
            if not chunk:
                break
            chunks.append(chunk)
        elif process.poll() is not None:
            break
    os.close(main)
    code = process.wait(timeout=max(1.0, give_up - time.monotonic()))
    assert process.stderr is not None
    errors = process.stderr.read().decode(errors="replace")
    out = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    return subprocess.CompletedProcess(process.args, code, out, errors)
