"""heap.py: older objects are out of the collector's view during a step, and handed back after."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from quiesce.coordinator import Coordinator
from quiesce.coordinator.attempt import Progress
from quiesce.coordinator.heap import ENV, frozen_step, heap_frozen
from tests.coordinator.helpers import assert_all_accepting


class _Node:
    """A reference cycle's member (collectable only by the cycle collector)."""

    def __init__(self) -> None:
        self.other: Any = self


@pytest.fixture(autouse=True)
def _no_freeze_left() -> Iterator[None]:
    assert gc.get_freeze_count() == 0
    yield
    leftover = gc.get_freeze_count()
    gc.unfreeze()
    assert leftover == 0


def test_older_objects_are_frozen_for_the_step_and_collected_after_it() -> None:
    old = _Node()
    alive = weakref.ref(old)
    with heap_frozen():
        assert gc.get_freeze_count() > 0
        del old  # older garbage: the collector does not see it during the step
        gc.collect()
        assert alive() is not None
        young = _Node()  # created during the step: collected as usual
        young_ref = weakref.ref(young)
        del young
        gc.collect()
        assert young_ref() is None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None  # nothing leaked


def test_only_the_outermost_step_freezes_and_unfreezes() -> None:
    with heap_frozen():
        frozen = gc.get_freeze_count()
        with heap_frozen():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen  # the inner step's end hands nothing back
    assert gc.get_freeze_count() == 0


def test_a_host_freeze_a_disabled_collector_or_the_switch_is_respected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gc.freeze()  # the host program's own permanent generation
    try:
        count = gc.get_freeze_count()
        with heap_frozen():
            assert gc.get_freeze_count() == count
        assert gc.get_freeze_count() == count  # not unfrozen by us
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with heap_frozen():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
    monkeypatch.setenv(ENV, "0")
    with heap_frozen():
        assert gc.get_freeze_count() == 0


@pytest.mark.anyio
async def test_frozen_step_wraps_an_async_function() -> None:
    seen: list[int] = []

    @frozen_step
    async def step(x: int) -> int:
        seen.append(gc.get_freeze_count())
        return x + 1

    assert await step(1) == 2
    assert seen[0] > 0
    assert gc.get_freeze_count() == 0


@pytest.mark.anyio
async def test_a_step_that_fails_or_is_cancelled_hands_the_heap_back() -> None:
    import anyio

    @frozen_step
    async def failing() -> None:
        assert gc.get_freeze_count() > 0
        raise RuntimeError("the step failed")

    @frozen_step
    async def slow() -> None:
        await anyio.sleep(30)

    with pytest.raises(RuntimeError, match="the step failed"):
        await failing()
    assert gc.get_freeze_count() == 0
    with anyio.move_on_after(0.05) as scope:
        await slow()
    assert scope.cancelled_caught
    assert gc.get_freeze_count() == 0


@pytest.mark.anyio
async def test_a_save_against_real_servers_runs_frozen_and_leaves_nothing_frozen(
    cluster: Any, sqlite_url: str, configure: Any
) -> None:
    config = configure(cluster, sqlite_url, fanout="parallel")
    counts: dict[str, int] = {}

    def progress(p: Progress) -> None:
        counts.setdefault(p.phase, gc.get_freeze_count())

    async with Coordinator.open(config, on_progress=progress) as coord:
        attempt = await coord.checkpoint(deadline_s=20)
        assert attempt.snapshot is not None
        assert gc.get_freeze_count() == 0
        async with coord.save(deadline_s=20) as second:
            in_block = gc.get_freeze_count()  # the caller's own block is not a step
        assert second.snapshot is not None
    assert in_block == 0
    assert sorted(counts) == ["commit", "prepare", "publish", "resume"]
    assert all(count > 0 for count in counts.values()), counts
    async with httpx.AsyncClient() as http:
        await assert_all_accepting(http, cluster)
