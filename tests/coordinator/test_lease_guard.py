"""`LeaseGuard` (coordinator/lease.py): the steps of a coordinator whose lease is found lost stop at
once. The whole behaviour, with real processes, is in `tests/recovery/test_standby.py` (a
SIGSTOPped coordinator, continued after a standby took over, exits without waiting for its call
in flight); these check the guard's own rule."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from quiesce.coordinator.lease import LeaseGuard
from quiesce.ledger import FencedError

LOST = FencedError("ledger L: the coordinator lease was taken over by another coordinator")

pytestmark = pytest.mark.anyio


async def test_a_running_step_is_cancelled_at_its_await_when_the_lease_is_lost() -> None:
    guard = LeaseGuard()
    reached: list[str] = []

    async def step() -> None:
        with guard.guard() as scope:
            reached.append("waiting")
            await anyio.sleep(3600)
            reached.append("woke")  # never: the loss cancels the wait
        reached.append("cancelled" if scope.cancelled_caught else "ended")

    async with anyio.create_task_group() as tg:
        tg.start_soon(step)
        await anyio.wait_all_tasks_blocked()
        guard.lost(LOST)
    assert reached == ["waiting", "cancelled"]
    assert guard.is_lost


async def test_a_step_started_after_the_loss_is_cancelled_before_its_first_await_completes() -> None:
    guard = LeaseGuard()
    guard.lost(LOST)
    with guard.guard() as scope:
        await anyio.sleep(3600)
    assert scope.cancelled_caught


async def test_steps_that_ended_are_not_touched_and_a_step_without_loss_runs_through() -> None:
    guard = LeaseGuard()
    with guard.guard() as scope:
        await anyio.lowlevel.checkpoint()
    guard.lost(LOST)
    assert not scope.cancelled_caught
    assert not scope.cancel_called  # an ended step is no longer held by the guard
