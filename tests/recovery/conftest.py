"""Fixtures for the recovery tests: the coordinator tests' cluster fixtures, and simulated deaths.

`die_after(n)` makes the next `Coordinator.open` in this process stop dead right after its n-th
durable append (1 is `coordinator.started`), the way `QUIESCE_CRASH_AT` does in a child process:
the hook raises `Died` — a `FencedError`, which the coordinator never catches, so nothing is rolled
back or recorded on the way out — and the test then recovers with a new coordinator. The real
SIGKILL path is covered by the subprocess tests and the crash matrix.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from quiesce.coordinator import crashpoints
from tests.coordinator.conftest import cluster, configure, make_cluster, sqlite_url, token
from tests.recovery.helpers import Dying, Predicate

__all__ = ["cluster", "configure", "die_after", "make_cluster", "sqlite_url", "token"]


@pytest.fixture
def die_after(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Dying]:
    """`die_after(when, nth=1)`: the next coordinator opened in this process dies right after its
    `nth` append of an event matching `when` (`kind_is(...)`, or `lambda e: True` to count all)."""

    def arm(when: Predicate, nth: int = 1) -> Dying:
        dying = Dying(when, nth)
        calls = {"n": 0}

        def from_env(environ: object = None) -> crashpoints.CrashPoints | None:
            calls["n"] += 1
            return dying if calls["n"] == 1 else None

        monkeypatch.setattr(crashpoints, "from_env", from_env)
        return dying

    return arm
