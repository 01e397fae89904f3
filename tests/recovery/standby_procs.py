"""The standby tests' coordinator processes (`standby_child.py`) and what they leave to compare.

- `spawn(role, config, token)`: a coordinator child in `role` (`active` or `standby`), the token
  in its environment only; `line(process)`: its next JSON line (its stderr when it has none);
- `wait_for(predicate)`: poll an async predicate until it holds (fails after `timeout_s`);
- `requests_of(logs)`: the requests of servers' control logs, without their outcomes (a request
  sent before a coordinator was stopped may be answered later);
- `event_time(event)`: an event's `at` as a UNIX time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio

from quiesce.coordinator.protocol import TOKEN_ENV
from quiesce.ledger import Event
from quiesce.tools.gymsim.cluster import IMPORT_ROOT

__all__ = ["event_time", "line", "requests_of", "spawn", "wait_for"]


def spawn(role: str, config: Path, token: str) -> subprocess.Popen[str]:
    env = {**os.environ, TOKEN_ENV: token, "PYTHONPATH": str(IMPORT_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.recovery.standby_child", role, str(config)],
        cwd=str(IMPORT_ROOT),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def line(process: subprocess.Popen[str]) -> dict[str, Any]:
    assert process.stdout is not None
    text = process.stdout.readline()
    assert text, process.stderr.read() if process.stderr else "no output"
    document: dict[str, Any] = json.loads(text)
    return document


async def wait_for(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 60.0) -> None:
    give_up = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < give_up, "timed out"
        await anyio.sleep(0.05)


def requests_of(logs: dict[str, list[dict[str, Any]]]) -> dict[str, list[tuple[Any, ...]]]:
    return {name: [(e["method"], e["path"], e["checkpoint_id"]) for e in log] for name, log in logs.items()}


def event_time(event: Event) -> float:
    return datetime.strptime(event.at, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
