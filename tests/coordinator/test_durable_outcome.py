"""What is on disk when a caller is told an outcome: a save answered "published" has its
`attempt.published` on disk, not only committed — on both planes, leaving `save()`/`checkpoint()`
and the step-wise `publish()` — while the disk sync runs beside the servers' resume.

The observer is the kernel call itself: every `fdatasync` the process makes is wrapped, and at its
start a separate connection reads the newest committed seq; an fdatasync covers every commit made
before it, so the largest such seq is on disk after a power loss. (Before this rule, the write-behind
records of a successful save reached the disk only when the ledger closed.)"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path

import pytest

from quiesce.coordinator import ClusterConfig, Coordinator, parse_config
from quiesce.ledger import Ledger
from quiesce.tools.gymsim.cluster import RunningCluster, start_cluster
from quiesce.tools.gymsim.spec import default_v2_spec
from tests.coordinator.helpers import read_events

pytestmark = pytest.mark.anyio


class SyncedSeqs:
    """The newest seq committed when each fdatasync of the process began (see the module docstring)."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.seqs: list[int] = []
        self._lock = threading.Lock()

    def newest_committed(self) -> int:
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        try:
            row = conn.execute("SELECT max(seq) FROM events").fetchone()
            return int(row[0] or 0)
        finally:
            conn.close()

    @property
    def on_disk(self) -> int:
        with self._lock:
            return max(self.seqs, default=0)

    def record(self, seq: int) -> None:
        with self._lock:
            self.seqs.append(seq)


@pytest.fixture
def synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SyncedSeqs:
    watcher = SyncedSeqs(tmp_path / "ledger.db")
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        if watcher.db.exists():
            watcher.record(watcher.newest_committed())
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    return watcher


async def _published_seq(url: str, checkpoint_id: str) -> int:
    return next(e.seq for e in await read_events(url, checkpoint_id) if e.kind == "attempt.published")


def _config(running: RunningCluster, tmp_path: Path) -> ClusterConfig:
    url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    return parse_config(running.config(url, tmp_path / "snapshots"), base_dir=tmp_path)


async def test_a_save_answered_published_has_it_on_disk(
    cluster: RunningCluster, tmp_path: Path, synced: SyncedSeqs
) -> None:
    config = _config(cluster, tmp_path)
    async with Coordinator.open(config) as coord:
        attempt = await coord.checkpoint(deadline_s=20)
        answered_with = synced.on_disk  # read the moment the caller is answered, ledger still open
        url = coord._ctx.ledger.url
        published = await _published_seq(url, attempt.checkpoint_id)
    assert attempt.snapshot is not None
    assert answered_with >= published, (answered_with, published)


async def test_the_step_wise_publish_returns_with_it_on_disk(
    cluster: RunningCluster, tmp_path: Path, synced: SyncedSeqs
) -> None:
    config = _config(cluster, tmp_path)
    async with Coordinator.open(config) as coord:
        attempt = await coord.prepare(deadline_s=20)
        await coord.commit(attempt)
        await coord.publish(attempt)
        answered_with = synced.on_disk
        published = await _published_seq(coord._ctx.ledger.url, attempt.checkpoint_id)
        assert answered_with >= published, (answered_with, published)
        await coord.resume(attempt)


async def test_a_v2_save_answered_published_has_it_on_disk(
    tmp_path: Path, synced: SyncedSeqs, token: str
) -> None:
    with start_cluster(default_v2_spec().model_dump(mode="json"), token=token) as running:
        config = _config(running, tmp_path)
        async with Coordinator.open(config) as coord:
            attempt = await coord.checkpoint(deadline_s=20)
            answered_with = synced.on_disk
            published = await _published_seq(coord._ctx.ledger.url, attempt.checkpoint_id)
    assert attempt.snapshot is not None
    assert answered_with >= published, (answered_with, published)


async def test_sync_makes_write_behind_commits_durable_on_postgres_too(ledger_url: str) -> None:
    """`Ledger.sync`: after write-behind appends, the database's flushed WAL (PostgreSQL) or the
    fdatasynced WAL (SQLite) covers them when it returns; a second sync has nothing to do."""
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch({"coordinator": {"host": "h", "pid": 1, "uuid": "u"}, "version": "t"})
        for n in range(3):
            await ledger.append("call.sent", checkpoint_id=None, server="s", call_id=f"c{n}",
                                data={"phase": "x", "method": "POST", "path": "/p", "url": "http://h/p",
                                      "timeout_s": 1.0, "body": None}, durable=False)  # fmt: skip
        await ledger.stage("call.replied", checkpoint_id=None, server="s", call_id="c2",
                           data={"status": 200, "body": {}, "elapsed_s": 0.1})  # fmt: skip
        if ledger_url.startswith("postgresql"):
            from sqlalchemy import text
            from sqlalchemy.ext.asyncio import create_async_engine

            engine = create_async_engine(ledger_url)
            try:
                await ledger.flush()  # the staged reply committed (write-behind), not yet flushed
                async with engine.connect() as conn:
                    written = (await conn.execute(text("SELECT pg_current_wal_insert_lsn()::text"))).scalar()
                    await ledger.sync()
                    flushed = (
                        await conn.execute(
                            text("SELECT pg_current_wal_flush_lsn() >= CAST(CAST(:lsn AS text) AS pg_lsn)"),
                            {"lsn": written},
                        )
                    ).scalar()
            finally:
                await engine.dispose()
            assert flushed is True
        else:
            await ledger.sync()
        assert (await ledger.head()) is not None
        assert (await ledger.head()).kind == "call.replied"  # type: ignore[union-attr]
        await ledger.sync()  # nothing owed: returns at once
