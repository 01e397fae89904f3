"""The CPU one ``Ledger`` uses, counted where it runs: measure #12's save cost.

A real ledger's cost per save, taken as the difference of two coordinators' CPU (real ledger minus
null ledger), is a few milliseconds between two noisy totals of about 35: its interval spans ±30%
even over hundreds of saves, too wide to see whether it grows by 10%. ``LedgerCpu`` counts the
ledger's own CPU directly instead:

- every public coroutine method of the ledger (on that instance only) is run one step at a time
  (``coroutine.send``/``throw``, as the event loop would), and the CPU time of the calling thread
  (``time.thread_time``) is counted for each step — the ledger's code between two awaits, commits
  made on the event loop's thread included — and never while the coroutine is suspended (other
  tasks run then: the HTTP calls, the servers' replies);
- a function that a step hands to a worker thread (``anyio.to_thread.run_sync``: a commit moved
  off the loop, the fsync of ``Ledger.sync``, a read) is counted on that thread, by its own thread
  CPU clock, when it runs. Work that other code hands to a thread (the coordinator's file work)
  is not: only a call made while a metered step runs is taken.

Nested calls count once: a step that runs inside another metered step (a public method calling
another) adds nothing of its own. The wrappers cost about a microsecond per step, which counts
against the ledger. What no clock here sees is indirect: caches and the allocator's state that
the ledger's work leaves to other code. ``real − null`` (reported beside) includes that.

Installing the thread hook replaces ``anyio.to_thread.run_sync`` for the process: a bench child only.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from types import TracebackType
from typing import Any

import anyio.to_thread

from quiesce.ledger import Ledger


def wrap_public_coroutines(
    ledger: Ledger, wrap: Callable[[Callable[..., Coroutine[Any, Any, Any]]], Callable[..., Awaitable[Any]]]
) -> None:
    """Replace every public coroutine method of ``ledger`` (this instance only) by ``wrap(method)``."""
    for name in dir(type(ledger)):
        method = getattr(ledger, name)
        if not name.startswith("_") and inspect.iscoroutinefunction(method):
            setattr(ledger, name, wrap(method))


class LedgerCpu:
    """Seconds of CPU one ledger used since it was metered (``total``); see the module docstring."""

    def __init__(self, ledger: Ledger) -> None:
        self.total = 0.0
        self._depth = 0  # metered steps running on the event loop's thread (nested: > 1)
        self._lock = threading.Lock()  # worker threads add to `total` too
        self._run_sync: Callable[..., Awaitable[Any]] | None = None
        wrap_public_coroutines(ledger, self._wrap)

    def __enter__(self) -> LedgerCpu:
        original = anyio.to_thread.run_sync
        self._run_sync = original
        meter = self

        async def run_sync(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if meter._depth == 0:  # not the ledger's: the coordinator's own work
                return await original(func, *args, **kwargs)

            def counted(*inner: Any) -> Any:
                start = time.thread_time()
                try:
                    return func(*inner)
                finally:
                    used = time.thread_time() - start
                    with meter._lock:
                        meter.total += used

            return await original(counted, *args, **kwargs)

        anyio.to_thread.run_sync = run_sync  # type: ignore[assignment]
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._run_sync is not None:
            anyio.to_thread.run_sync = self._run_sync  # type: ignore[assignment]
            self._run_sync = None

    def _wrap(self, method: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Awaitable[Any]]:
        meter = self

        async def metered(*args: Any, **kwargs: Any) -> Any:
            return await _Stepped(meter, method(*args, **kwargs))

        return metered

    def _step(self, send: Callable[[Any], Any], value: Any) -> Any:
        """``send(value)``: one step of a metered coroutine, its CPU counted unless an outer step's is."""
        outer = self._depth > 0
        self._depth += 1
        start = 0.0 if outer else time.thread_time()
        try:
            return send(value)
        finally:
            self._depth -= 1
            if not outer:
                used = time.thread_time() - start
                with self._lock:
                    self.total += used


class _Stepped:
    """Awaits ``coro`` one step at a time through ``meter._step`` (values, errors and closing passed on)."""

    __slots__ = ("_coro", "_meter")

    def __init__(self, meter: LedgerCpu, coro: Coroutine[Any, Any, Any]) -> None:
        self._meter, self._coro = meter, coro

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, step = self._coro, self._meter._step
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                if error is not None:
                    thrown, error = error, None
                    yielded = step(coro.throw, thrown)
                else:
                    yielded = step(coro.send, value)
            except StopIteration as stop:
                return stop.value
            try:
                value = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as raised:  # a cancellation, delivered into the coroutine
                error = raised
