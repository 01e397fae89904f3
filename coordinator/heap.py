"""Keeping the garbage collector off the process's older objects while a protocol step runs.

A fan-out to hundreds of servers allocates tens of thousands of objects that live as long as
their call (tasks, requests, ledger events). The collector promotes them to its oldest
generation, and that generation's full collections then walk every object of the process —
imported modules, the host program's own data — about twice per save at 512 servers, 0.1–0.2 s
of CPU each time (``python -m quiesce.tools.bench --only 4``). ``heap_frozen()`` moves the objects that
exist when a step starts out of the collector's view (``gc.freeze``) and hands them back when the
last overlapping step ends (``gc.unfreeze``), so collections during a step walk only what the
step created.

Invariants:
- Nothing is leaked: an older object that becomes garbage during the step is collected by the
  first full collection after it. Objects created during the step are collected as usual.
- Only the outermost of nested or overlapping steps in the process freezes, and it alone
  unfreezes (a process-wide count).
- Nothing is done when the host program froze objects itself (``gc.get_freeze_count() > 0``:
  that permanent generation is its own), when the collector is disabled, or when the environment
  sets ``QUIESCE_GC_FREEZE=0``. A host that calls ``gc.freeze()`` while a step runs has those
  objects unfrozen with the step's.
- The user's block inside ``Coordinator.save()`` (writing the trainer's state) is not a step:
  the collector sees the whole heap while it runs.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Final, ParamSpec, TypeVar

__all__ = ["ENV", "frozen_step", "heap_frozen"]

_P = ParamSpec("_P")
_R = TypeVar("_R")

#: Set to ``0`` to turn the freezing off.
ENV: Final = "QUIESCE_GC_FREEZE"

_lock = threading.Lock()
_depth = 0
_froze = False


def _enter() -> None:
    global _depth, _froze
    with _lock:
        _depth += 1
        if _depth == 1:
            _froze = os.environ.get(ENV, "1") != "0" and gc.isenabled() and gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()


def _exit() -> None:
    global _depth, _froze
    with _lock:
        _depth -= 1
        if _depth == 0 and _froze:
            _froze = False
            gc.unfreeze()


@contextmanager
def heap_frozen() -> Iterator[None]:
    """Run the block with the objects that exist now out of the collector's view (module docstring)."""
    _enter()
    try:
        yield
    finally:
        _exit()


def frozen_step(fn: Callable[_P, Awaitable[_R]]) -> Callable[_P, Awaitable[_R]]:
    """An async function run inside ``heap_frozen()`` (a protocol step of the ``Coordinator``)."""

    @functools.wraps(fn)
    async def step(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with heap_frozen():
            return await fn(*args, **kwargs)

    return step
