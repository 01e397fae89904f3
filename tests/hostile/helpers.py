"""The real command line in a child process, for the hostile tests that check what a user sees."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from quiesce.coordinator.protocol import TOKEN_ENV

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, token: str | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m quiesce.tools.cli.main ARGS` from the repository's root (this tree's code), with a control
    token in the environment; stdout and stderr captured as text. Never raises on a non-zero exit."""
    env = {**os.environ, TOKEN_ENV: token or "qz-" + secrets.token_hex(8)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "quiesce.tools.cli.main", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=timeout_s,
    )


def no_traceback(done: subprocess.CompletedProcess[str]) -> None:
    """A user-facing failure: one message, no Python traceback, no internal exception names."""
    assert "Traceback" not in done.stderr, done.stderr
    assert "sqlalchemy" not in done.stderr.lower(), done.stderr
    assert "sqlite3." not in done.stderr, done.stderr
