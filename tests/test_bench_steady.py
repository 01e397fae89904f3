"""Measure #1's steady-state probes read a real SQLite WAL correctly: the frames a commit wrote, and
how often the WAL has been restarted from its beginning. Nothing here asserts a time."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from quiesce.tools.bench.ledger import _Raw, wal_frames, wal_resets


def test_frames_and_restarts_of_a_real_wal(tmp_path: Path) -> None:
    database = tmp_path / "probe.db"
    assert (wal_resets(database), wal_frames(database)) == (0, None)  # no WAL yet
    raw = _Raw(database, "normal")
    try:
        raw.pair(0)
        before = wal_frames(database)
        assert before is not None
        raw.pair(1)  # two commits, each one events page and one index page
        after = wal_frames(database)
        assert after is not None
        assert after - before == 4
        assert raw.fsyncs == 4  # NORMAL: one fdatasync of the WAL per commit, by the bench itself
        first = wal_resets(database)
        # a full checkpoint, then a commit: SQLite restarts the WAL from its beginning
        raw.conn.execute("PRAGMA wal_checkpoint(RESTART)")
        raw.pair(2)
        assert wal_resets(database) == first + 1
        frames = wal_frames(database)
        assert frames is not None
        assert frames < after  # rewritten from the start, not grown
    finally:
        raw.close()
    with sqlite3.connect(database) as check:
        assert check.execute("SELECT count(*) FROM events").fetchone() == (6,)
