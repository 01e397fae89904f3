"""Staged events: chained at once, committed in front of the next transaction, lost only by a crash."""

from __future__ import annotations

import contextlib
import signal
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from quiesce.ledger import Event, FencedError, Ledger, LedgerError, replay_url
from quiesce.ledger.backend import InlineAppend
from tests.ledger.helpers import COORDINATOR, REPLIED, SENT, run_and_kill, started

pytestmark = pytest.mark.anyio


def _spy(ledger: Ledger, record: Callable[[Any], None]) -> None:
    """Call ``record(batch)`` after each of the backend's transactions commits (both commit paths)."""
    backend: Any = ledger.backend
    if isinstance(ledger.backend, InlineAppend):
        # SQLite: both commit paths go through ``append_now`` (here, or on the writer's thread)
        real_now = backend.append_now

        def now(batch: Any) -> None:
            real_now(batch)
            record(batch)

        backend.append_now = now
        return
    real_append = backend.append

    async def later(batch: Any) -> None:
        await real_append(batch)
        record(batch)

    backend.append = later


def _counting(ledger: Ledger) -> list[list[str]]:
    """The kinds each of the backend's transactions wrote, from now on."""
    transactions: list[list[str]] = []
    _spy(ledger, lambda batch: transactions.append([e.kind for e in batch.events]))
    return transactions


@contextlib.contextmanager
def _failing_commits(backend: Any) -> Iterator[None]:
    """Every commit raises an injected disk error, on both commit paths, until the block ends."""

    def fail(batch: Any) -> None:
        raise LedgerError("disk I/O error (injected)")

    async def fail_later(batch: Any) -> None:
        fail(batch)

    backend.append_now, backend.append = fail, fail_later  # instance attributes shadow the methods
    try:
        yield
    finally:
        del backend.append_now, backend.append


async def _stored(url: str) -> list[Event]:
    async with Ledger.open(url, readonly=True) as reader:
        return [e async for e in reader.read()]


async def test_staged_events_ride_in_the_next_transaction_in_seq_order(ledger_url: str) -> None:
    hooked: list[list[int]] = []

    def hook(events: Sequence[Event]) -> None:
        hooked.append([e.seq for e in events])

    async with Ledger.open(ledger_url, after_append=hook) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.append("attempt.started", checkpoint_id="c", data=started())
        transactions = _counting(ledger)
        hooked.clear()
        sent = await ledger.append("call.sent", checkpoint_id="c", server="s", call_id="k1", data=SENT)
        replied = await ledger.stage(
            "call.replied", checkpoint_id="c", server="s", call_id="k1", data=REPLIED
        )
        done = await ledger.stage("phase.completed", checkpoint_id="c", data={"phase": "prepare"})
        # final at once: numbered after the head, chained, with the stored payload
        assert (replied.seq, done.seq) == (sent.seq + 1, sent.seq + 2)
        assert (replied.prev_hash, done.prev_hash) == (sent.hash, replied.hash)
        assert await ledger.last_seq() == done.seq
        # nothing written yet: another connection sees the head at the call.sent
        assert [e.seq for e in await _stored(ledger_url)][-1] == sent.seq
        assert transactions == [["call.sent"]]
        assert hooked == [[sent.seq]]
        nxt = await ledger.append("call.sent", checkpoint_id="c", server="t", call_id="k2", data=SENT)
        assert nxt.seq == done.seq + 1
        assert transactions[-1] == ["call.replied", "phase.completed", "call.sent"]
        # after_append: each staged event once, as its own group, before the carrier's
        assert hooked == [[sent.seq], [replied.seq], [done.seq], [nxt.seq]]
        stored = await _stored(ledger_url)
        assert stored[-4:] == [sent, replied, done, nxt]
        row = await ledger.attempt("c", stored=True)
        assert row is not None
        # the projection folded every carried event: the phase.completed counted the first call
        assert (row.calls, row.last_seq) == (1, done.seq)
    assert (await replay_url(ledger_url)).ok


async def test_a_staged_event_can_ask_for_a_durable_carrier(ledger_url: str) -> None:
    """``stage(durable=True)``: the transaction that carries it is durable even when the append it
    rides with is write-behind (``attempt.started`` with an attempt's first ``call.sent``); the
    next transaction is write-behind again."""
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        batches: list[tuple[list[str], bool]] = []
        _spy(ledger, lambda batch: batches.append(([e.kind for e in batch.events], batch.durable)))
        begun = await ledger.stage("attempt.started", checkpoint_id="c", data=started(), durable=True)
        await ledger.stage("phase.started", checkpoint_id="c", data={"phase": "prepare"})
        await ledger.append(
            "call.sent", checkpoint_id="c", server="s", call_id="k1", data=SENT, durable=False
        )
        await ledger.stage("call.replied", checkpoint_id="c", server="s", call_id="k1", data=REPLIED)
        await ledger.append(
            "call.sent", checkpoint_id="c", server="t", call_id="k2", data=SENT, durable=False
        )
        await ledger.stage("attempt.aborting", checkpoint_id="c", data={"reason": "test"}, durable=True)
        await ledger.flush()  # a flush is write-behind, unless a staged event asks otherwise
        await ledger.stage("phase.started", checkpoint_id="c", data={"phase": "resume"})
        await ledger.flush()
        assert batches == [
            (["attempt.started", "phase.started", "call.sent"], True),
            (["call.replied", "call.sent"], False),
            (["attempt.aborting"], True),
            (["phase.started"], False),
        ]
        row = await ledger.attempt("c")
        assert row is not None
        assert (row.state, row.calls, row.started_at) == ("resume", 2, begun.at)
    assert (await replay_url(ledger_url)).ok


async def test_flush_reads_and_close_commit_what_is_staged(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.append("attempt.started", checkpoint_id="c", data=started())
        transactions = _counting(ledger)
        await ledger.flush()  # nothing staged: no transaction
        assert transactions == []
        a = await ledger.stage("phase.started", checkpoint_id="c", data={"phase": "prepare"})
        await ledger.flush()
        assert transactions == [["phase.started"]]
        assert (await _stored(ledger_url))[-1] == a
        # a read through the writer commits its staged events first, so it sees them
        b = await ledger.stage("phase.completed", checkpoint_id="c", data={"phase": "prepare", "summary": {}})
        assert (await ledger.head()) == b
        c = await ledger.stage("phase.started", checkpoint_id="c", data={"phase": "commit"})
        row = await ledger.attempt("c")
        assert row is not None
        assert (row.state, row.last_seq) == ("commit", c.seq)
        d = await ledger.stage("phase.completed", checkpoint_id="c", data={"phase": "commit", "summary": {}})
        assert [e.seq async for e in ledger.read(after=c.seq)] == [d.seq]
        e = await ledger.stage("phase.started", checkpoint_id="c", data={"phase": "publish"})
        assert [r.checkpoint_id for r in await ledger.attempts()] == ["c"]
        f = await ledger.stage("attempt.aborting", checkpoint_id="c", data={"reason": "test"})
    # closing committed the last one
    stored = await _stored(ledger_url)
    assert [ev.seq for ev in stored[-3:]] == [d.seq, e.seq, f.seq]
    assert stored[-1] == f
    assert (await replay_url(ledger_url)).ok


async def test_an_invalid_staged_event_is_refused_and_stages_nothing(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        head = await ledger.last_seq()
        with pytest.raises(LedgerError, match=r"call\.replied"):
            await ledger.stage(
                "call.replied", checkpoint_id="c", server="s", call_id="k", data={"status": "x"}
            )
        with pytest.raises(LedgerError, match="needs"):
            await ledger.stage("call.replied", checkpoint_id="c", data=REPLIED)
        assert await ledger.last_seq() == head
        ev = await ledger.append("attempt.started", checkpoint_id="c", data=started())
        assert ev.seq == head + 1
    assert (await replay_url(ledger_url)).ok


async def test_readonly_and_closed_ledgers_refuse_to_stage(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
    async with Ledger.open(ledger_url, readonly=True) as reader:
        with pytest.raises(LedgerError, match="readonly"):
            await reader.stage("phase.started", checkpoint_id="c", data={"phase": "prepare"})
    with pytest.raises(LedgerError, match="closed"):
        await ledger.stage("phase.started", checkpoint_id="c", data={"phase": "prepare"})


async def test_staging_while_a_commit_is_in_flight_chains_after_it(ledger_url: str) -> None:
    """A commit running in a worker thread (slow disk): events staged meanwhile are numbered after
    its rows, and the next transaction carries them — the stored chain has no gap and verifies."""
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.append("attempt.started", checkpoint_id="c", data=started())
        backend: Any = ledger.backend
        backend.can_append_now = lambda: False  # every commit takes the awaited path
        staged: list[Event] = []
        sent: list[Event] = []

        async def send(i: int) -> None:
            event = await ledger.append(
                "call.sent", checkpoint_id="c", server=f"s{i}", call_id=f"k{i}", data=SENT
            )
            sent.append(event)

        async def stage_during() -> None:
            await anyio.lowlevel.checkpoint()  # the sends lead first and start committing
            for i in range(3):
                staged.append(
                    await ledger.stage(
                        "call.replied", checkpoint_id="c", server=f"s{i}", call_id=f"k{i}", data=REPLIED
                    )
                )

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(send, i)
            tg.start_soon(stage_during)
        last = await ledger.append("attempt.aborting", checkpoint_id="c", data={"reason": "done"})
        assert last.seq == max(e.seq for e in sent + staged) + 1
    stored = await _stored(ledger_url)
    assert [e.seq for e in stored] == list(range(1, last.seq + 1))
    for event in sent + staged + [last]:
        assert stored[event.seq - 1] == event
    assert (await replay_url(ledger_url)).ok


async def test_a_failed_transaction_loses_its_staged_events_and_stops_the_writer(ledger_url: str) -> None:
    """A commit that fails while carrying staged events cannot keep the promise made for them (seq
    and hash were handed out): the ledger refuses every later append until it is reopened, and
    what was stored still verifies."""
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        kept = await ledger.append("attempt.started", checkpoint_id="c", data=started())
        await ledger.stage("phase.started", checkpoint_id="c", data={"phase": "prepare"})
        with _failing_commits(ledger.backend), pytest.raises(LedgerError, match="injected"):
            await ledger.append("call.sent", checkpoint_id="c", server="s", call_id="k", data=SENT)
        with pytest.raises(
            LedgerError,
            match=r"an append failed \(.*injected.*\) and 1 staged event of this writer was lost.*reopen",
        ):
            await ledger.append("call.sent", checkpoint_id="c", server="s", call_id="k", data=SENT)
        with pytest.raises(LedgerError, match="reopen"):
            await ledger.stage("phase.started", checkpoint_id="c", data={"phase": "prepare"})
    async with Ledger.open(ledger_url) as ledger:
        head = await ledger.head()
        assert head == kept
        await ledger.start_epoch(COORDINATOR)
    assert (await replay_url(ledger_url)).ok


async def test_a_failed_transaction_without_staged_events_only_rereads_the_head(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        with _failing_commits(ledger.backend), pytest.raises(LedgerError, match="injected"):
            await ledger.append("attempt.started", checkpoint_id="c", data=started())
        ev = await ledger.stage("phase.started", checkpoint_id="c", data={"phase": "prepare"})
        assert ev.seq == 2  # the head was read again before chaining on it
        await ledger.append("attempt.started", checkpoint_id="c", data=started())
    assert (await replay_url(ledger_url)).ok


async def test_a_fenced_writer_refuses_to_stage(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        ledger._fenced = FencedError("another coordinator took over (test)")
        with pytest.raises(FencedError, match="took over"):
            await ledger.stage("phase.started", checkpoint_id="c", data={"phase": "prepare"})


async def test_a_killed_writer_keeps_what_was_carried_and_loses_only_the_staged_tail(ledger_url: str) -> None:
    """SIGKILL a real writer: events carried by a commit survive, the still-staged tail is gone,
    and the stored ledger is a verified prefix of the chain the writer had handed out."""
    child = textwrap.dedent(
        f"""
        import anyio
        from quiesce.ledger import Ledger

        async def main():
            ledger = await Ledger.connect({ledger_url!r})
            await ledger.append("attempt.started", checkpoint_id="c", data={started()!r})
            await ledger.append("call.sent", checkpoint_id="c", server="s", call_id="k1", data={SENT!r})
            carried = await ledger.stage(
                "call.replied", checkpoint_id="c", server="s", call_id="k1", data={REPLIED!r}
            )
            sent = await ledger.append(
                "call.sent", checkpoint_id="c", server="t", call_id="k2", data={SENT!r}, durable=False
            )
            lost = await ledger.stage(
                "call.replied", checkpoint_id="c", server="t", call_id="k2", data={REPLIED!r}
            )
            print(carried.seq, carried.hash, sent.seq, lost.seq, flush=True)
            await anyio.sleep(3600)

        anyio.run(main)
        """
    )
    line, returncode = await anyio.to_thread.run_sync(run_and_kill, child)
    assert returncode == -signal.SIGKILL
    carried_seq, carried_hash, sent_seq, lost_seq = line.split()
    stored = await _stored(ledger_url)
    by_seq = {e.seq: e for e in stored}
    assert by_seq[int(carried_seq)].hash == carried_hash
    assert (stored[-1].seq, stored[-1].kind) == (int(sent_seq), "call.sent")
    assert int(lost_seq) not in by_seq
    report = await replay_url(ledger_url)
    assert report.ok
    async with Ledger.open(ledger_url) as ledger:  # a new writer chains on the stored head
        await ledger.start_epoch(COORDINATOR)
        assert await ledger.last_seq() == int(sent_seq) + 1


async def test_a_writer_whose_lease_ran_out_drops_its_staged_events_at_close(tmp_path: Path) -> None:
    """Closing commits what is staged — unless the writer may no longer write (its lease ran out:
    a standby may own the ledger now). Then nothing is written and closing does not raise."""
    from quiesce.ledger import LeaseTerms

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with Ledger.open(url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        kept = await ledger.append("attempt.started", checkpoint_id="c", data=started())
        await ledger.stage("phase.started", checkpoint_id="c", data={"phase": "prepare"})
        ledger._lease, ledger._lease_until = LeaseTerms(holder="test", ttl_s=0.1), 0.0  # ran out
    assert (await _stored(url))[-1] == kept
    assert (await replay_url(url)).ok
