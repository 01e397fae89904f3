"""The fence of spec §1.1, rule by rule, on the `Fence` object itself."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from quiesce.coordinator.protocol import CommonBody
from quiesce.tools.gymsim.common import ControlRejection
from quiesce.tools.gymsim.fence import Done, Fence, rule

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


def body(checkpoint_id: str = "c1") -> CommonBody:
    return CommonBody(checkpoint_id=checkpoint_id, deadline_ts=time.time() + 30)


def make_fence() -> Fence:
    return Fence(
        {
            "prepare": rule(("idle",), "preparing", "prepared"),
            "commit": rule(("prepared",), "committing", "committed_paused"),
            "restore": rule(
                ("idle", "restore_failed_paused"), "restoring", "restored_paused", "restore_failed_paused"
            ),
            "resume": rule(
                ("idle", "prepared", "committed_paused", "restored_paused"), None, "idle", retires=True
            ),
        }
    )


class Counter:
    def __init__(self) -> None:
        self.runs = 0

    async def ok(self) -> dict[str, Any]:
        self.runs += 1
        return {"run": self.runs}

    async def fail(self) -> dict[str, Any]:
        self.runs += 1
        raise ControlRejection("boom", "failed on purpose")


async def rejected(fence: Fence, op: str, checkpoint_id: str, action: Any) -> str:
    with pytest.raises(ControlRejection) as info:
        await fence.run(op, body(checkpoint_id), action)
    return info.value.code


async def test_success_records_and_moves_to_after() -> None:
    fence, counter = make_fence(), Counter()
    assert await fence.run("prepare", body(), counter.ok) == {"run": 1}
    assert fence.snapshot()["phase"] == "prepared"
    assert fence.snapshot()["active_checkpoint_id"] == "c1"
    assert fence.snapshot()["deadline_ts"] is not None


async def test_recorded_result_is_replayed_unchanged_without_running_again() -> None:
    fence, counter = make_fence(), Counter()
    first = await fence.run("prepare", body(), counter.ok)
    await fence.run("commit", body(), counter.ok)
    # prepare is no longer allowed in committed_paused, but its recorded result replays.
    assert await fence.run("prepare", body(), counter.ok) == first
    assert counter.runs == 2


async def test_duplicate_in_flight_is_coalesced() -> None:
    fence = make_fence()
    gate = asyncio.Event()
    runs = 0

    async def slow() -> dict[str, Any]:
        nonlocal runs
        runs += 1
        await gate.wait()
        return {"slow": True}

    first = asyncio.create_task(fence.run("prepare", body(), slow))
    await asyncio.sleep(0)
    second = asyncio.create_task(fence.run("prepare", body(), slow))
    await asyncio.sleep(0)
    assert fence.phase == "preparing"
    gate.set()
    assert await first == await second == {"slow": True}
    assert runs == 1


async def test_coalesced_duplicate_gets_the_failure_too() -> None:
    fence = make_fence()
    gate = asyncio.Event()

    async def slow_fail() -> dict[str, Any]:
        await gate.wait()
        raise ControlRejection("boom", "no")

    first = asyncio.create_task(fence.run("prepare", body(), slow_fail))
    await asyncio.sleep(0)
    second = asyncio.create_task(fence.run("prepare", body(), slow_fail))
    await asyncio.sleep(0)
    gate.set()
    for task in (first, second):
        with pytest.raises(ControlRejection) as info:
            await task
        assert info.value.code == "boom"
    assert fence.phase == "idle"


async def test_another_active_id_is_a_conflict() -> None:
    fence, counter = make_fence(), Counter()
    await fence.run("prepare", body("c1"), counter.ok)
    assert await rejected(fence, "commit", "c2", counter.ok) == "checkpoint_conflict"
    assert await rejected(fence, "resume", "c2", counter.ok) == "checkpoint_conflict"
    assert fence.active_checkpoint_id == "c1"


async def test_phase_not_allowed_is_invalid_phase() -> None:
    fence, counter = make_fence(), Counter()
    assert await rejected(fence, "commit", "c1", counter.ok) == "invalid_phase"
    assert counter.runs == 0
    assert fence.snapshot() == {"phase": "idle", "active_checkpoint_id": None, "deadline_ts": None}


async def test_failure_returns_to_the_previous_phase_and_records_nothing() -> None:
    fence, counter = make_fence(), Counter()
    assert await rejected(fence, "prepare", "c1", counter.fail) == "boom"
    assert fence.snapshot() == {"phase": "idle", "active_checkpoint_id": None, "deadline_ts": None}
    # Nothing recorded: the retry runs again and may succeed.
    assert await fence.run("prepare", body(), counter.ok) == {"run": 2}
    assert await rejected(fence, "commit", "c1", counter.fail) == "boom"
    assert (fence.phase, fence.active_checkpoint_id) == ("prepared", "c1")


async def test_failure_phase_keeps_the_id_active() -> None:
    fence, counter = make_fence(), Counter()
    assert await rejected(fence, "restore", "c1", counter.fail) == "boom"
    assert (fence.phase, fence.active_checkpoint_id) == ("restore_failed_paused", "c1")
    assert await rejected(fence, "restore", "c2", counter.ok) == "checkpoint_conflict"
    await fence.run("restore", body("c1"), counter.ok)
    assert fence.phase == "restored_paused"


async def test_unexpected_exception_becomes_internal_error_for_waiters() -> None:
    fence = make_fence()

    async def crash() -> dict[str, Any]:
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError):
        await fence.run("prepare", body(), crash)
    assert fence.phase == "idle"


async def test_only_resume_retires_and_the_id_is_stale_forever() -> None:
    fence, counter = make_fence(), Counter()
    await fence.run("prepare", body(), counter.ok)
    await fence.run("commit", body(), counter.ok)
    assert fence.active_checkpoint_id == "c1"
    resumed = await fence.run("resume", body(), counter.ok)
    assert fence.snapshot() == {"phase": "idle", "active_checkpoint_id": None, "deadline_ts": None}
    # a repeated resume replays its recorded result; every other operation is stale
    assert await fence.run("resume", body(), counter.ok) == resumed
    for op in ("prepare", "commit", "restore"):
        assert await rejected(fence, op, "c1", counter.ok) == "stale_checkpoint"
    # a new id works
    await fence.run("prepare", body("c2"), counter.ok)
    assert fence.active_checkpoint_id == "c2"


async def test_resume_from_idle_with_a_new_id_retires_it() -> None:
    fence, counter = make_fence(), Counter()
    await fence.run("resume", body("r1"), counter.ok)
    assert fence.is_retired("r1")
    assert await rejected(fence, "prepare", "r1", counter.ok) == "stale_checkpoint"


async def test_action_may_choose_the_after_phase() -> None:
    fence = make_fence()

    async def action() -> Done:
        return Done({"x": 1}, after="preparing")

    await fence.run("prepare", body(), action)
    assert fence.snapshot()["phase"] == "preparing"
    fence.advance("preparing", "prepared")
    assert fence.snapshot()["phase"] == "prepared"


async def test_status_query_rules() -> None:
    fence, counter = make_fence(), Counter()
    allowed = frozenset({"prepared"})
    with pytest.raises(ControlRejection) as info:
        fence.check_query("c1", allowed)  # type: ignore[arg-type]
    assert info.value.code == "invalid_phase"
    await fence.run("prepare", body("c1"), counter.ok)
    fence.check_query("c1", allowed)  # type: ignore[arg-type]
    with pytest.raises(ControlRejection) as info:
        fence.check_query("c2", allowed)  # type: ignore[arg-type]
    assert info.value.code == "checkpoint_conflict"
    await fence.run("resume", body("c1"), counter.ok)
    with pytest.raises(ControlRejection) as info:
        fence.check_query("c1", None)
    assert info.value.code == "stale_checkpoint"
