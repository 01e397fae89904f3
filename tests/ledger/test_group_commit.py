"""Group commit: concurrent appends share transactions, yet each returns only once durable, in order."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from quiesce.ledger import Event, Ledger, LedgerError, replay_url
from quiesce.ledger.backend import InlineAppend
from tests.ledger.helpers import COORDINATOR, REPLIED, SENT, started

pytestmark = pytest.mark.anyio


async def test_concurrent_appends_are_batched_in_order_and_each_durable(ledger_url: str) -> None:
    seen: list[list[int]] = []

    def record(events: Sequence[Event]) -> None:
        seen.append([e.seq for e in events])

    results: dict[int, list[Event]] = {}
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        ledger.after_append = record
        backend = ledger.backend
        transactions: list[int] = []
        real_append = backend.append

        async def counting_append(batch: Any) -> None:
            transactions.append(len(batch.rows))
            await real_append(batch)

        backend.append = counting_append  # type: ignore[method-assign]

        async def call(i: int) -> None:
            sent = await ledger.append(
                "call.sent", checkpoint_id="c1", server=f"s{i}", call_id=f"k{i}", data=SENT
            )
            await anyio.sleep(0.001 * (i % 7))
            replied = await ledger.append(
                "call.replied", checkpoint_id="c1", server=f"s{i}", call_id=f"k{i}", data=REPLIED
            )
            results[i] = [sent, replied]

        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(call, i)
        stored = [e async for e in ledger.read()]
    assert len(stored) == 401
    assert sum(transactions) == 400
    assert len(transactions) < 300, "concurrent appends should share transactions"
    assert [e.seq for e in stored] == list(range(1, 402))
    for i, (sent, replied) in results.items():
        assert sent.seq < replied.seq
        assert stored[sent.seq - 1] == sent
        assert stored[replied.seq - 1] == replied
        assert (sent.call_id, replied.call_id) == (f"k{i}", f"k{i}")
    # after_append: once per append, with exactly its own events, in seq order
    assert len(seen) == 400
    assert [seq for group in seen for seq in group] == list(range(2, 402))
    assert (await replay_url(ledger_url)).ok


async def test_a_cancelled_append_still_commits_and_others_are_unaffected(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)

        async def one(i: int) -> None:
            await ledger.append("call.sent", checkpoint_id="c1", server="s", call_id=f"k{i}", data=SENT)

        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                for i in range(10):
                    tg.start_soon(one, i)
                scope.cancel()
        after = await ledger.append("call.sent", checkpoint_id="c1", server="s", call_id="last", data=SENT)
        stored = [e async for e in ledger.read()]
    assert stored[-1] == after
    assert [e.seq for e in stored] == list(range(1, len(stored) + 1))
    assert (await replay_url(ledger_url)).ok


def _awaiting_commits(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every commit of ``ledger`` await its backend (SQLite otherwise commits a lone append
    inline, without awaiting): the path of a PostgreSQL writer, and of SQLite on a slow disk."""
    if isinstance(ledger.backend, InlineAppend):
        monkeypatch.setattr(ledger.backend, "can_append_now", lambda: False)


class _Spy:
    """Counts ``Ledger._commit_alone`` calls (the lone-append path) of one ledger."""

    def __init__(self, ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = ledger._commit_alone

        async def spy(*args: Any, **kwargs: Any) -> list[Event]:
            self.calls += 1
            return await real(*args, **kwargs)

        monkeypatch.setattr(ledger, "_commit_alone", spy)


async def test_a_lone_append_cancelled_during_its_commit_lands_whole(
    ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lone-append path (no waiter of its own): a cancellation that arrives while the database
    commits it does not interrupt the commit; the event is stored and chained, ``after_append``
    saw it, the caller is cancelled afterwards, and the next append chains on it."""
    notified: list[int] = []
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        _awaiting_commits(ledger, monkeypatch)
        spy = _Spy(ledger, monkeypatch)
        ledger.after_append = lambda events: notified.extend(e.seq for e in events)
        in_flight = anyio.Event()
        backend = ledger.backend
        real_append = backend.append

        async def signalling_append(batch: Any) -> None:
            in_flight.set()
            await real_append(batch)  # not cancellable (Backend.append)

        backend.append = signalling_append  # type: ignore[method-assign]
        returned: list[Event] = []

        async def lone() -> None:
            returned.append(
                await ledger.append("call.sent", checkpoint_id="c1", server="s", call_id="k1", data=SENT)
            )
            await anyio.lowlevel.checkpoint()  # where the cancellation reaches it

        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lone)
                await in_flight.wait()  # the commit has started and awaits the database
                scope.cancel()
        assert scope.cancelled_caught
        assert spy.calls == 1
        assert len(returned) == 1, "the append returned its event; the cancellation came after"
        assert notified == [returned[0].seq]
        backend.append = real_append  # type: ignore[method-assign]
        after = await ledger.append(
            "call.replied", checkpoint_id="c1", server="s", call_id="k1", data=REPLIED
        )
        stored = [e async for e in ledger.read()]
        row = await ledger.attempt("c1")
    assert stored[-2:] == [returned[0], after]
    assert after.prev_hash == returned[0].hash
    assert row is not None
    # the call is counted (live); the row's last change is still its attempt.started
    assert (row.calls, row.last_seq) == (1, stored[-3].seq)
    assert stored[-3].kind == "attempt.started"
    assert (await replay_url(ledger_url)).ok


async def _lone_then_queued(
    ledger: Ledger,
    one: Callable[[str], Coroutine[Any, Any, None]],
    n: int,
    in_flight: anyio.Event,
    release: anyio.Event,
) -> int:
    """Run ``one("lone")``; once its commit is in flight, ``one("k0")`` .. ``one("k<n-1>")``; when
    they all wait, release the lone commit and let every append end. Returns how many appends were
    queued just before the release."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "lone")
        await in_flight.wait()
        for i in range(n):
            tg.start_soon(one, f"k{i}")
        await anyio.wait_all_tasks_blocked()
        queued = len(ledger._queue)
        release.set()
    return queued


async def test_appends_arriving_during_a_lone_commit_share_the_next_transaction(
    ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a lone append commits, appends that arrive queue behind it and then commit together in
    one transaction (group commit holds), in arrival order, each returning its own events."""
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        _awaiting_commits(ledger, monkeypatch)
        spy = _Spy(ledger, monkeypatch)
        backend = ledger.backend
        real_append = backend.append
        transactions: list[list[str | None]] = []
        release = anyio.Event()
        in_flight = anyio.Event()

        async def held_append(batch: Any) -> None:
            transactions.append([row[5] for row in batch.rows])
            if len(transactions) == 1:
                in_flight.set()
                await release.wait()  # the first commit takes long: the others arrive meanwhile
            await real_append(batch)

        backend.append = held_append  # type: ignore[method-assign]
        results: dict[str, Event] = {}

        async def one(call_id: str) -> None:
            results[call_id] = await ledger.append(
                "call.sent", checkpoint_id="c1", server="s", call_id=call_id, data=SENT
            )

        queued = await _lone_then_queued(ledger, one, 20, in_flight, release)
        assert queued == 20, "the later appends wait behind the lone commit"
        stored = [e async for e in ledger.read()]
    assert spy.calls == 1
    assert transactions == [["lone"], [f"k{i}" for i in range(20)]]
    assert [e.call_id for e in stored[1:]] == ["lone", *(f"k{i}" for i in range(20))]
    assert all(stored[e.seq - 1] == e for e in results.values())
    assert (await replay_url(ledger_url)).ok


async def test_a_failed_lone_commit_hands_the_lead_to_the_appends_queued_behind_it(
    ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone commit that fails (outcome unknown: here, nothing was written) raises to its caller
    only; the appends queued behind it re-read the head and commit, chained on what is stored."""
    async with Ledger.open(ledger_url) as ledger:
        first = await ledger.start_epoch(COORDINATOR)
        _awaiting_commits(ledger, monkeypatch)
        _Spy(ledger, monkeypatch)
        backend = ledger.backend
        real_append = backend.append
        release = anyio.Event()
        in_flight = anyio.Event()
        calls = 0

        async def failing_first(batch: Any) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                in_flight.set()
                await release.wait()
                raise LedgerError("the connection broke (simulated)")
            await real_append(batch)

        backend.append = failing_first  # type: ignore[method-assign]
        outcomes: dict[str, object] = {}

        async def one(call_id: str) -> None:
            try:
                outcomes[call_id] = await ledger.append(
                    "call.sent", checkpoint_id="c1", server="s", call_id=call_id, data=SENT
                )
            except LedgerError as error:
                outcomes[call_id] = error

        await _lone_then_queued(ledger, one, 5, in_flight, release)
        stored = [e async for e in ledger.read()]
    assert isinstance(outcomes["lone"], LedgerError)
    assert [e.call_id for e in stored] == [None, *(f"k{i}" for i in range(5))]
    assert stored[1].prev_hash == first.hash
    assert all(outcomes[f"k{i}"] == stored[i + 1] for i in range(5))
    assert (await replay_url(ledger_url)).ok
