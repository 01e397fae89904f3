"""The SQLite writer's WAL upkeep between operations: the write-behind tail synced and the WAL
checkpointed once the writer is quiet after a ``sync``, off every commit's path; never before the
writer is quiet, never after the ledger closed, and a failed fdatasync stays owed.

Real SQLite files; the only stand-ins are a failing ``fdatasync`` (the failure case) and the
module's thresholds, lowered so one test's handful of commits reaches them."""

from __future__ import annotations

import shutil
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from quiesce.ledger import AppendItem, Ledger, sqlite_upkeep
from quiesce.ledger.sqlite import SqliteBackend
from tests.ledger.helpers import COORDINATOR, REPLIED, SENT, started

pytestmark = pytest.mark.anyio

#: Generous bounds for the upkeep thread to act on a loaded test machine (it acts after 10 ms).
ACT_WITHIN_S = 10.0


def _url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"


def _backend(ledger: Ledger) -> SqliteBackend:
    backend = ledger.backend
    assert isinstance(backend, SqliteBackend)
    return backend


def _upkeep_of(ledger: Ledger) -> sqlite_upkeep.WalUpkeep:
    upkeep = _backend(ledger)._upkeep
    assert upkeep is not None, "a writing SQLite ledger has a WAL upkeep"
    return upkeep


async def _write_behind(ledger: Ledger, n: int, checkpoint_id: str = "c1") -> None:
    for i in range(n):
        await ledger.append(
            "call.sent", checkpoint_id=checkpoint_id, server="s", call_id=f"{checkpoint_id}/{i}",
            data=SENT, durable=False,
        )  # fmt: skip
        await ledger.stage(
            "call.replied", checkpoint_id=checkpoint_id, server="s", call_id=f"{checkpoint_id}/{i}",
            data=REPLIED,
        )  # fmt: skip


async def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + ACT_WITHIN_S
    while not condition():
        assert time.monotonic() < deadline, f"the upkeep did not {what} within {ACT_WITHIN_S}s"
        await anyio.sleep(0.005)


async def _still_owed_after_quiet(backend: SqliteBackend) -> None:
    """The writer stays quiet for five times ``QUIET_S``: an unarmed upkeep leaves the tail owed."""
    await anyio.sleep(5 * sqlite_upkeep.QUIET_S)
    assert backend._unsynced, "the upkeep synced a tail nobody armed it for"


def _events_in_database_file(db: Path, copy: Path) -> int:
    """Events in the database file alone (its WAL left out): what a checkpoint has copied back."""
    shutil.copyfile(db, copy)
    conn = sqlite3.connect(copy)
    try:
        return int(conn.execute("SELECT count(*) FROM events").fetchone()[0])
    finally:
        conn.close()


def _upkeep_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "quiesce-wal-upkeep"]


async def test_the_write_behind_tail_after_a_sync_reaches_the_disk_once_the_writer_is_quiet(
    tmp_path: Path,
) -> None:
    async with Ledger.open(_url(tmp_path)) as ledger:
        await ledger.start_epoch(COORDINATOR)
        backend = _backend(ledger)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        await _write_behind(ledger, 3)
        await ledger.sync(ending=False)  # an operation tells its outcome while it goes on
        await _write_behind(ledger, 3)  # the tail: committed after the sync, owed to the disk
        await ledger.flush()
        await _still_owed_after_quiet(backend)  # quiet, but not armed: nothing has synced it yet
        ledger.operation_ended()  # the upkeep is armed
        await _until(lambda: not backend._unsynced, "sync the write-behind tail")


async def test_a_commit_after_the_round_waits_for_the_next_operations_end(tmp_path: Path) -> None:
    # one round per arm: what is committed after it is owed to the next durable commit, the next
    # operation's end or the close, never synced by a round nobody asked for
    async with Ledger.open(_url(tmp_path)) as ledger:
        await ledger.start_epoch(COORDINATOR)
        backend = _backend(ledger)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        await ledger.sync()  # armed
        assert await anyio.to_thread.run_sync(backend.upkeep_settled, ACT_WITHIN_S)  # its round ran
        await _write_behind(ledger, 2)
        await ledger.flush()
        await _still_owed_after_quiet(backend)  # no round ran for it
        ledger.operation_ended()
        await _until(lambda: not backend._unsynced, "sync the tail once armed again")


async def test_a_writer_that_keeps_committing_is_not_synced_under_its_feet(tmp_path: Path) -> None:
    async with Ledger.open(_url(tmp_path)) as ledger:
        await ledger.start_epoch(COORDINATOR)
        backend = _backend(ledger)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        await ledger.sync()  # armed: the upkeep waits for the writer to be quiet
        synced_while_busy = 0
        # commits 2 ms apart for 150 ms: never 10 ms of quiet, so the tail stays owed throughout
        for i in range(75):
            await ledger.append(
                "call.sent", checkpoint_id="c1", server="s", call_id=f"c1/{i}", data=SENT, durable=False
            )
            synced_while_busy += not backend._unsynced
            await anyio.sleep(0.002)
        # the loop's own sleeps can overrun on a loaded machine; a quiet gap then lets it act once
        assert synced_while_busy <= 5, f"synced {synced_while_busy} times while commits kept coming"
        # a gap that let it act spent that arm: the commits after it wait for the next one
        ledger.operation_ended()
        await _until(lambda: not backend._unsynced, "sync once the commits stopped")


async def test_the_wal_is_checkpointed_between_operations_not_inside_a_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_upkeep, "CHECKPOINT_AFTER_COMMITS", 5)
    db = tmp_path / "ledger.db"
    async with Ledger.open(_url(tmp_path)) as ledger:
        await ledger.start_epoch(COORDINATOR)
        upkeep = _upkeep_of(ledger)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        await _write_behind(ledger, 6)
        await ledger.flush()
        head = await ledger.head()
        assert head is not None
        # SQLite's own checkpoint (1,000 pages) is far off: the database file lacks these events
        assert _events_in_database_file(db, tmp_path / "before.db") < head.seq
        await ledger.sync()
        await _until(lambda: upkeep.checkpoints == 1, "checkpoint the WAL")
        assert _events_in_database_file(db, tmp_path / "after.db") == head.seq
        # fewer than the threshold since: the next operation's end does not checkpoint again
        await _write_behind(ledger, 1, "c2")
        await ledger.sync()
        await _until(lambda: not _backend(ledger)._unsynced, "sync the tail")
        await anyio.sleep(0.05)
        assert upkeep.checkpoints == 1


async def test_a_few_large_group_commits_are_checkpointed_like_many_small_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a wide fan-out commits hundreds of events per transaction: counted in commits alone, its
    # WAL would grow to SQLite's own checkpoint (inside some later commit) before the upkeep's
    monkeypatch.setattr(sqlite_upkeep, "CHECKPOINT_AFTER_EVENTS", 40)
    db = tmp_path / "ledger.db"
    async with Ledger.open(_url(tmp_path)) as ledger:
        await ledger.start_epoch(COORDINATOR)
        upkeep = _upkeep_of(ledger)

        def sent(cid: str, n: int) -> list[AppendItem]:
            return [AppendItem("call.sent", cid, f"s{i}", f"{cid}/{i}", SENT) for i in range(n)]

        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        await ledger.append_many(sent("c1", 30), durable=False)  # 32 events in 3 commits: under it
        await ledger.sync()
        await _until(lambda: not _backend(ledger)._unsynced, "sync the tail")
        await anyio.sleep(0.05)
        assert upkeep.checkpoints == 0
        replied = [AppendItem("call.replied", "c1", f"s{i}", f"c1/{i}", REPLIED) for i in range(30)]
        await ledger.append_many(replied, durable=False)  # 62 events in 4 commits: past it
        head = await ledger.head()
        assert head is not None
        assert _events_in_database_file(db, tmp_path / "before.db") < head.seq
        await ledger.sync()
        await _until(lambda: upkeep.checkpoints == 1, "checkpoint the WAL")
        assert _events_in_database_file(db, tmp_path / "after.db") == head.seq


async def test_a_failed_fdatasync_in_the_upkeep_stays_owed_to_the_next_durable_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Ledger.open(_url(tmp_path)) as ledger:
        await ledger.start_epoch(COORDINATOR)
        backend = _backend(ledger)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        tried = threading.Event()
        real_fsync = backend._fsync_wal

        def failing() -> None:
            if threading.current_thread().name == "quiesce-wal-upkeep":
                tried.set()
                raise OSError(5, "Input/output error")
            real_fsync()

        monkeypatch.setattr(backend, "_fsync_wal", failing)
        await _write_behind(ledger, 2)
        await ledger.flush()
        assert backend._unsynced
        ledger.operation_ended()  # armed only now: a round run before the tail has nothing owed
        await _until(tried.is_set, "try to sync")
        await anyio.sleep(0.02)
        assert backend._unsynced  # still owed: the failure changed nothing it promised
        await ledger.append("phase.started", checkpoint_id="c1", data={"phase": "commit"})  # durable
        assert not backend._unsynced


async def test_closing_stops_the_upkeep_and_syncs_what_is_owed(tmp_path: Path) -> None:
    before = set(_upkeep_threads())
    async with Ledger.open(_url(tmp_path)) as ledger:
        await ledger.start_epoch(COORDINATOR)
        backend = _backend(ledger)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        await ledger.sync()
        started_threads = set(_upkeep_threads()) - before
        assert len(started_threads) == 1
        await _write_behind(ledger, 2)  # closed at once: the upkeep has not had its quiet 10 ms
    assert not backend._unsynced
    (thread,) = started_threads
    assert not thread.is_alive()
    # a ledger that never syncs never starts the thread
    async with Ledger.open(_url(tmp_path)) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await _write_behind(ledger, 1, "c2")
        assert set(_upkeep_threads()) - before == set()


async def test_settled_tells_when_the_upkeep_has_nothing_pending_or_running(tmp_path: Path) -> None:
    async with Ledger.open(_url(tmp_path)) as ledger:
        await ledger.start_epoch(COORDINATOR)
        backend = _backend(ledger)
        assert backend.upkeep_settled(0)  # never armed: nothing to wait for
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        await ledger.sync()
        pending = 0
        for i in range(20):  # commits 2 ms apart: the round waits for quiet, so it stays pending
            await ledger.append(
                "call.sent", checkpoint_id="c1", server="s", call_id=f"c1/{i}", data=SENT, durable=False
            )
            pending += not backend.upkeep_settled(0)
            await anyio.sleep(0.002)
        assert pending >= 15, f"settled while commits kept coming ({20 - pending} of 20)"
        ledger.operation_ended()  # a gap that let a round run spent that arm: arm again
        assert await anyio.to_thread.run_sync(backend.upkeep_settled, ACT_WITHIN_S)
        assert not backend._unsynced  # settled once the round ran: the tail is on disk


def test_a_stop_that_lands_just_before_a_round_begins_still_ends_the_thread(tmp_path: Path) -> None:
    # `stop` sets the stopping flag, then arms so the thread wakes; the thread clears the arm as
    # it begins a round. A stop landing between the end of the quiet wait and that clear must
    # still end the thread, not leave it waiting for an arm that will never come (seen: a
    # ledger's close hung in `stop`'s join).
    db = tmp_path / "plain.db"
    sqlite3.connect(db).close()
    rounds: list[int] = []
    upkeep = sqlite_upkeep.WalUpkeep(db, lambda: rounds.append(1))

    class StopBeforeClear(threading.Event):
        def clear(self) -> None:
            upkeep._stopping.set()  # what `stop` does first...
            self.set()  # ...and then
            super().clear()

    upkeep._armed = StopBeforeClear()
    upkeep.arm()
    stopper = threading.Thread(target=upkeep.stop, daemon=True)
    deadline = time.monotonic() + ACT_WITHIN_S
    while upkeep._thread is None or upkeep._thread.is_alive():
        assert time.monotonic() < deadline, "the upkeep thread did not end after a stop"
        time.sleep(0.005)
    stopper.start()
    stopper.join(ACT_WITHIN_S)
    assert not stopper.is_alive(), "stop() did not return"
    assert rounds == []  # the stopped thread began no round: closing syncs what is owed
