"""The standby tests' coordinator processes (`standby_child.py`) and what they leave to compare.

- `spawn(role, config, token)`: a coordinator child in `role` (`active` or `standby`), the token
  in its environment only; `line(process)`: its next JSON line (its stderr when it has none);
- `wait_for(predicate)`: poll an async predicate until it holds (fails after `timeout_s`);
- `requests_of(logs)`: the requests of servers' control logs, without their outcomes (a request
  sent before a coordinator was stopped may be answered later);
- `event_time(event)`: an event's `at` as a UNIX time;
- `assert_took_over(...)`: the standby's takeover of a SIGKILLed active coordinator's save, as
  the ledger shows it; `assert_zombie_silent(...)`: a woken zombie sent and appended nothing.
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
from quiesce.ledger import Event, Ledger
from quiesce.tools.gymsim.cluster import IMPORT_ROOT
from tests.coordinator.helpers import read_events

__all__ = [
    "LEASE_S",
    "assert_took_over",
    "assert_zombie_silent",
    "event_time",
    "line",
    "requests_of",
    "spawn",
    "wait_for",
]

#: the coordinators' lease in the standby tests: short, so a takeover comes soon after a death
LEASE_S = 2.0


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


async def assert_took_over(
    url: str, opened: dict[str, Any], took: dict[str, Any], killed_at: float, lease_s: float
) -> None:
    """The standby (`took`) took over from the active coordinator (`opened`) in the next epoch,
    after the old lease had expired (one host, one clock), and rolled its save back from prepare;
    the attempt's row says aborted, recovered by the standby's epoch."""
    assert took["took_over_from"]["holder"] == opened["holder"]
    assert took["epoch"] == opened["epoch"] + 1
    recovered = took["recovery"]["attempts"]
    assert [(a["found"], a["action"]) for a in recovered] == [("prepare", "resumed")]
    events = await read_events(url)
    started = next(ev for ev in events if ev.kind == "coordinator.started" and ev.epoch == took["epoch"])
    assert event_time(started) >= took["took_over_from"]["expires_at"]
    print(
        f"\nstandby: new epoch {event_time(started) - killed_at:.2f}s after SIGKILL (lease {lease_s:g}s),"
        f" recovered {took['at'] - killed_at:.2f}s after it"
    )
    async with Ledger.open(url, readonly=True) as ledger:
        row = await ledger.attempt(recovered[0]["checkpoint_id"])
    assert row is not None
    assert (row.outcome, row.recovered_by) == ("aborted", took["epoch"])


async def assert_zombie_silent(
    url: str,
    opened: dict[str, Any],
    took: dict[str, Any],
    logs: tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]]],
    events_before: list[Event],
) -> None:
    """The zombie (`opened`), woken after the standby (`took`) took over, sent nothing (`logs`:
    the servers' control logs before it woke and after it exited; a request it sent before it
    was stopped may have been answered since, so requests are compared, not their outcomes) and
    appended nothing: after the standby's start, no event of the zombie's epoch."""
    assert took["epoch"] == opened["epoch"] + 1
    before, after = logs
    assert requests_of(after) == requests_of(before)
    events_after = await read_events(url)
    assert events_after == events_before
    started = next(
        ev for ev in events_after if ev.kind == "coordinator.started" and ev.epoch == took["epoch"]
    )
    assert [ev for ev in events_after if ev.seq > started.seq and ev.epoch == opened["epoch"]] == []
