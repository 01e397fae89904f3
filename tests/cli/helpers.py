"""Running the command line as an operator does: `python -m quiesce.tools.cli.main ...` in a real process.

`quiesce(*argv, cwd=..., env=...)` runs this tree's CLI (its root first on `PYTHONPATH`, the
caller's `QUIESCE_CONFIG` removed) in `cwd` and returns the finished process, output as text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    *argv: str, cwd: Path, env: Mapping[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """Run `quiesce ARGV` as a real process in `cwd`."""
    return subprocess.run(
        command(*argv),
        cwd=cwd,
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def json_of(done: subprocess.CompletedProcess[str]) -> Any:
    """The one JSON document a `--json` run printed on stdout."""
    assert done.stdout.strip(), done.stderr
    return json.loads(done.stdout)
