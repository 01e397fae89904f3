"""The Ledger on real databases (SQLite file and PostgreSQL): appends, reads, the writer rules."""

from __future__ import annotations

import os
import signal
import textwrap
from pathlib import Path

import anyio
import pytest
from sqlalchemy.exc import DBAPIError

from quiesce.ledger import AppendItem, FencedError, Ledger, LedgerError, replay_url
from tests.ledger.helpers import COORDINATOR, REPLIED, SENT, is_sqlite, raw_sql, run_and_kill, started

pytestmark = pytest.mark.anyio


async def test_append_read_head_and_chain(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        assert await ledger.head() is None
        assert ledger.epoch == 0
        first = await ledger.start_epoch(COORDINATOR)
        assert (first.seq, first.epoch, first.kind, ledger.epoch) == (1, 1, "coordinator.started", 1)
        assert first.prev_hash == "0" * 64
        sent = await ledger.append("call.sent", checkpoint_id="c1", server="policy", call_id="k1", data=SENT)
        assert (sent.seq, sent.prev_hash, sent.epoch) == (2, first.hash, 1)
        assert sent.at.endswith("Z")
        assert len(sent.at) == len("2025-01-01T00:00:00.000000Z")
        assert await ledger.head() == sent
        assert [e async for e in ledger.read()] == [first, sent]
    assert (await replay_url(ledger_url)).ok


async def test_read_filters_and_pages_across_many_events(ledger_url: str) -> None:
    async with Ledger.open(ledger_url, durability="process") as ledger:
        items = []
        for i in range(2600):
            cid = "a" if i % 2 else "b"
            if i % 5 == 0:
                items.append(AppendItem("phase.started", checkpoint_id=cid, data={"phase": "prepare"}))
            else:
                items.append(
                    AppendItem("call.sent", checkpoint_id=cid, server="s", call_id=f"k{i}", data=SENT)
                )
        for start in range(0, len(items), 500):
            await ledger.append_many(items[start : start + 500])
        everything = [e.seq async for e in ledger.read()]
        assert everything == list(range(1, 2601))
        assert [e.seq async for e in ledger.read(after=2590)] == list(range(2591, 2601))
        only_a = [e async for e in ledger.read(checkpoint_id="a")]
        assert len(only_a) == 1300
        assert all(e.checkpoint_id == "a" for e in only_a)
        assert [e.seq for e in only_a] == sorted(e.seq for e in only_a)
        phases = [e async for e in ledger.read(kinds=["phase.started"], page_size=100)]
        assert len(phases) == 520
        assert {e.kind for e in phases} == {"phase.started"}
        both = [e async for e in ledger.read(checkpoint_id="b", kinds=["phase.started"], page_size=7)]
        assert len(both) == 260
        assert [e async for e in ledger.read(kinds=[])] == []


async def test_unknown_kind_invalid_payload_and_missing_columns_are_refused(ledger_url: str) -> None:
    async with Ledger.open(ledger_url, secrets=["tok-s3cret"]) as ledger:
        with pytest.raises(LedgerError, match=r"unknown event kind 'call\.lost'"):
            await ledger.append("call.lost", call_id="k", data={})
        with pytest.raises(LedgerError, match=r"invalid call\.sent payload") as info:
            await ledger.append("call.sent", call_id="k", data={**SENT, "surprise": "tok-s3cret"})
        assert "tok-s3cret" not in str(info.value)
        with pytest.raises(LedgerError, match="needs call_id"):
            await ledger.append("call.sent", data=SENT)
        with pytest.raises(LedgerError, match="needs checkpoint_id"):
            await ledger.append("attempt.started", data=started())
        with pytest.raises(LedgerError, match="not storable as JSON"):
            await ledger.append("call.replied", call_id="k", data={**REPLIED, "elapsed_s": float("inf")})
        assert await ledger.head() is None, "nothing was written"
        ok = await ledger.append("call.replied", call_id="k", data=REPLIED)
        assert ok.seq == 1


async def test_append_many_is_one_transaction(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        await ledger.append("attempt.started", checkpoint_id="c", data=started())
        with pytest.raises(LedgerError):
            await ledger.append_many(
                [
                    AppendItem("call.sent", checkpoint_id="c", call_id="1", data=SENT),
                    AppendItem("nope", data={}),
                ]
            )
        evs = await ledger.append_many(
            [
                AppendItem("call.sent", checkpoint_id="c", call_id=str(i), server="s", data=SENT)
                for i in range(3)
            ]
        )
        assert [e.seq for e in evs] == [2, 3, 4]
        assert [e.prev_hash for e in evs[1:]] == [e.hash for e in evs[:-1]]
        row = await ledger.attempt("c")
        assert row is not None
        assert (row.calls, row.last_seq) == (3, 1)  # counted, not yet by a stored row change


async def test_attempts_projection_is_updated_with_each_event(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started("save", ["p", "a"]))
        await ledger.append("phase.started", checkpoint_id="c1", data={"phase": "prepare"})
        row = await ledger.attempt("c1")
        assert row is not None
        assert (row.state, row.outcome, row.participants, row.epoch) == ("prepare", None, ("p", "a"), 1)
        await ledger.append("call.sent", checkpoint_id="c1", server="p", call_id="k", data=SENT)
        await ledger.append("call.failed", checkpoint_id="c1", server="p", call_id="k", data={
            "error": "connect", "detail": "refused", "elapsed_s": 0.1})  # fmt: skip
        await ledger.append("attempt.aborted", checkpoint_id="c1", data={"reason": "connect failed"})
        await ledger.append("attempt.started", checkpoint_id="c2", data=started("restore"))
        await ledger.append(
            "attempt.completed", checkpoint_id="c2", data={"servers": ["p"], "outcome": "restored"}
        )
        c1 = await ledger.attempt("c1")
        assert c1 is not None
        assert (c1.state, c1.outcome, c1.calls, c1.failures) == ("aborted", "aborted", 1, 1)
        assert c1.ended_at is not None
        assert await ledger.attempt("nope") is None
        rows = await ledger.attempts()
        assert [r.checkpoint_id for r in rows] == ["c1", "c2"]
        assert [r.checkpoint_id for r in await ledger.attempts(outcome="restored")] == ["c2"]
        assert [r.checkpoint_id for r in await ledger.attempts(since=rows[1].started_at)] == ["c2"]


async def test_epochs_fence_writers(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.start_epoch(COORDINATOR)
        assert ledger.epoch == 2
    async with Ledger.open(ledger_url) as ledger:
        assert ledger.epoch == 0
        with pytest.raises(FencedError, match="epoch 2 exists"):
            await ledger.append("call.sent", call_id="k", data=SENT)
        started_ev = await ledger.start_epoch(COORDINATOR)
        assert started_ev.epoch == ledger.epoch == 3
        await ledger.append("call.sent", call_id="k", data=SENT)


async def test_second_writer_is_refused_and_nothing_interleaves(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as first:
        await first.start_epoch(COORDINATOR)
        with pytest.raises(FencedError, match="already has a writer"):
            await Ledger.connect(ledger_url)
        async with Ledger.open(ledger_url, readonly=True) as reader:
            with pytest.raises(LedgerError, match="readonly"):
                await reader.append("call.sent", call_id="k", data=SENT)
            await first.append("call.sent", call_id="k", data=SENT)
            assert (await reader.head()) == (await first.head())
    async with Ledger.open(ledger_url) as again:  # released on close
        await again.start_epoch(COORDINATOR)
    report = await replay_url(ledger_url)
    assert (report.chain_ok, report.events) == (True, 3)


async def test_a_writer_that_lost_its_claim_is_fenced_in_the_transaction(ledger_url: str) -> None:
    """If the claim is bypassed, the append transaction itself refuses to interleave."""
    stale = await Ledger.connect(ledger_url)
    try:
        await stale.start_epoch(COORDINATOR)
        await stale.backend.close()  # drops the claim (and connections) behind the Ledger's back
        stale._backend = type(stale.backend)(  # type: ignore[call-arg]
            stale.backend._url if is_sqlite(ledger_url) else _pg_url(stale),  # type: ignore[attr-defined]
            where=stale.url, durability="full", readonly=False,
        )  # fmt: skip
        async with Ledger.open(ledger_url) as newer:
            await newer.start_epoch(COORDINATOR)
            await stale.backend.start()
            if not is_sqlite(ledger_url):
                stale.backend._writer = await stale.backend._engine.connect()  # type: ignore[attr-defined]
            with pytest.raises(FencedError, match="fenced"):
                await stale.append("call.sent", call_id="k", data=SENT)
            with pytest.raises(FencedError):  # and it stays fenced
                await stale.append("call.sent", call_id="k", data=SENT)
            await newer.append("call.sent", call_id="k2", data=SENT)
    finally:
        await stale.aclose()
    report = await replay_url(ledger_url)
    assert report.chain_ok
    assert report.events == 3


async def test_a_head_row_rewritten_under_a_running_sqlite_writer_fences_it(tmp_path: Path) -> None:
    """The SQLite append reads no head before inserting: the 0003 trigger refuses a row that does
    not link to the stored head's hash, even when the head's seq is the one the writer expects."""
    import sqlite3

    path = tmp_path / "q.db"
    async with Ledger.open(f"sqlite+aiosqlite:///{path}") as writer:
        await writer.start_epoch(COORDINATOR)
        await writer.append("call.sent", call_id="k1", data=SENT)
        head = await writer.head()
        assert head is not None
        # a hostile edit: the append-only triggers dropped, the head row's hash rewritten, the
        # triggers back (their SQL as the migrations created them)
        raw = sqlite3.connect(path, isolation_level=None)
        triggers = raw.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'").fetchall()
        raw.execute("BEGIN IMMEDIATE")
        for name, _ in triggers:
            raw.execute(f"DROP TRIGGER {name}")
        raw.execute("UPDATE events SET hash = ? WHERE seq = ?", ("f" * 64, head.seq))
        for _, sql in triggers:
            raw.execute(sql)
        raw.execute("COMMIT")
        raw.close()
        with pytest.raises(
            FencedError, match=f"its head \\(seq {head.seq}\\) is not the row this writer chained"
        ):
            await writer.append("call.sent", call_id="k2", data=SENT)
        with pytest.raises(FencedError):  # and it stays fenced
            await writer.append("call.sent", call_id="k3", data=SENT)
    report = await replay_url(f"sqlite+aiosqlite:///{path}")
    assert report.events == head.seq  # nothing went in after the rewritten head


def _pg_url(ledger: Ledger) -> object:
    return ledger.backend._engine.url  # type: ignore[attr-defined]


async def test_events_refuse_update_and_delete_at_the_database(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        await ledger.append("call.sent", call_id="k", data=SENT)
    for statement in ("UPDATE events SET kind = 'x' WHERE seq = 1", "DELETE FROM events WHERE seq = 1"):
        with pytest.raises(DBAPIError, match="append-only"):
            await raw_sql(ledger_url, statement)
    if not is_sqlite(ledger_url):
        with pytest.raises(DBAPIError, match="append-only"):
            await raw_sql(ledger_url, "TRUNCATE events")
    assert await raw_sql(ledger_url, "SELECT seq, kind FROM events") == [(1, "call.sent")]


async def test_append_is_durable_when_it_returns(ledger_url: str) -> None:
    """A child appends, reports the seq, and is SIGKILLed: the event is there, the chain verifies."""
    child = textwrap.dedent(
        f"""
        import sys, anyio
        from quiesce.ledger import Ledger

        async def main():
            ledger = await Ledger.connect({ledger_url!r})
            await ledger.append("attempt.started", checkpoint_id="c", data={started()!r})
            ev = await ledger.append("call.sent", checkpoint_id="c", server="s", call_id="k1", data={SENT!r})
            print(ev.seq, ev.hash, flush=True)
            await anyio.sleep(3600)

        anyio.run(main)
        """
    )
    line, returncode = await anyio.to_thread.run_sync(run_and_kill, child)
    seq, digest = line.split()
    assert returncode == -signal.SIGKILL
    async with Ledger.open(ledger_url) as ledger:
        head = await ledger.head()
        assert head is not None
        assert (head.seq, head.hash, head.kind, head.call_id) == (int(seq), digest, "call.sent", "k1")
        row = await ledger.attempt("c")
        assert row is not None
        assert row.calls == 1
        await ledger.append("call.replied", checkpoint_id="c", server="s", call_id="k1", data=REPLIED)
    report = await replay_url(ledger_url)
    assert report.ok
    assert report.events == 3


async def test_url_passwords_never_reach_the_database(ledger_url: str) -> None:
    """A server URL in the config may carry a password (`http://user:PASSWORD@host`): in a call's
    `url`, in an error text naming the server, anywhere in a payload, it is stored redacted —
    with no secret configured, and the rest of the URL kept."""
    password = "pw-5e4d3c2b1a"
    url = f"http://alice:{password}@gym.example:8000"
    async with Ledger.open(ledger_url) as ledger:
        await ledger.append("attempt.started", checkpoint_id="c", data=started())
        sent = await ledger.append(
            "call.sent", checkpoint_id="c", server="m", call_id="k", data={**SENT, "url": url + "/prepare"}
        )
        assert sent.data["url"] == "http://alice:<redacted>@gym.example:8000/prepare"
        failed = await ledger.append(
            "call.failed",
            checkpoint_id="c",
            server="m",
            call_id="k",
            data={"error": "connect", "status": None, "code": None, "detail": f"cannot reach {url}: refused",
                  "elapsed_s": 0.1},
        )  # fmt: skip
        assert failed.data["detail"] == "cannot reach http://alice:<redacted>@gym.example:8000: refused"
        plain = await ledger.append(  # no password: stored as given
            "call.sent", checkpoint_id="c", server="m", call_id="k2", data={**SENT, "url": "http://h:1/a@b"}
        )
        assert plain.data["url"] == "http://h:1/a@b"
        assert password not in str([e async for e in ledger.read()])
    dump = await raw_sql(ledger_url, "SELECT data FROM events")
    assert password not in str(dump)
    assert (await replay_url(ledger_url)).ok


async def test_secrets_never_reach_the_database(ledger_url: str, tmp_path: Path) -> None:
    token = "tok-9f8e7d6c5b4a-secret"
    async with Ledger.open(ledger_url, secrets=[token]) as ledger:
        await ledger.append("attempt.started", checkpoint_id="c", data=started())
        await ledger.append(
            "call.sent",
            checkpoint_id="c",
            server=f"s-{token}",
            call_id="k",
            data={
                **SENT,
                "body": {"headers": {"Authorization": "Bearer abc"}, "echo": f"x{token}y", token: 1},
            },
        )
        ev = await ledger.append(
            "call.replied",
            checkpoint_id="c",
            call_id="k",
            data={**REPLIED, "body": {"blob": token + "x" * 70_000}},
        )
        assert set(ev.data["body"]) == {"sha256", "bytes", "prefix"}
        assert ev.data["body"]["prefix"].startswith('{"blob":"<redacted>x')
        assert token not in str([e async for e in ledger.read()])
    if is_sqlite(ledger_url):
        from tests.ledger.helpers import sqlite_path

        base = Path(sqlite_path(ledger_url))
        files = [p for p in base.parent.iterdir() if p.name.startswith(base.name)]
        assert base in files
        blob = b"".join(p.read_bytes() for p in files)
        assert len(blob) > 0
        assert token.encode() not in blob
        assert b"Bearer abc" not in blob
    else:
        dump = await raw_sql(ledger_url, "SELECT string_agg(events::text, '|') FROM events")
        dump2 = await raw_sql(ledger_url, "SELECT string_agg(attempts::text, '|') FROM attempts")
        text = str(dump) + str(dump2)
        assert "<redacted>" in text
        assert token not in text
        assert "Bearer abc" not in text


async def test_write_behind_appends_survive_a_process_crash(ledger_url: str) -> None:
    """``durable=False`` events are committed when the append returns: readers see them at once,
    and a SIGKILLed writer loses none of them (nor the durable ones around them)."""
    child = textwrap.dedent(
        f"""
        import sys, anyio
        from quiesce.ledger import AppendItem, Ledger

        async def main():
            ledger = await Ledger.connect({ledger_url!r})
            await ledger.append("attempt.started", checkpoint_id="c", data={started()!r}, durable=False)
            await ledger.append("call.sent", checkpoint_id="c", server="s", call_id="k1", data={SENT!r})
            await ledger.append(
                "call.replied", checkpoint_id="c", server="s", call_id="k1", data={REPLIED!r}, durable=False
            )
            done = {{"phase": "prepare", "summary": {{}}}}
            items = [AppendItem("phase.completed", checkpoint_id="c", data=done)]
            ev = (await ledger.append_many(items, durable=False))[-1]
            seen = [e.seq async for e in ledger.read()]
            print(ev.seq, ev.hash, len(seen), flush=True)
            await anyio.sleep(3600)

        anyio.run(main)
        """
    )
    line, returncode = await anyio.to_thread.run_sync(run_and_kill, child)
    seq, digest, seen = line.split()
    assert returncode == -signal.SIGKILL
    assert int(seen) == 4  # the writer's own reads saw the write-behind events
    async with Ledger.open(ledger_url) as ledger:
        head = await ledger.head()
        assert head is not None
        assert (head.seq, head.hash, head.kind) == (int(seq), digest, "phase.completed")
        assert [e.kind async for e in ledger.read()] == [
            "attempt.started", "call.sent", "call.replied", "phase.completed",
        ]  # fmt: skip
        row = await ledger.attempt("c", stored=True)
        assert row is not None
        assert (row.calls, row.last_seq) == (1, 4)  # the phase.completed counted the call
    report = await replay_url(ledger_url)
    assert report.ok
    assert report.events == 4


async def test_write_behind_commits_skip_the_fsync_and_the_next_durable_one_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite under durability "full": the writer runs with synchronous=NORMAL; a durable append
    fdatasyncs the WAL once its COMMIT is done (holding every frame before it, write-behind ones
    included), a write-behind one does not, and closing after a write-behind commit fsyncs the
    WAL. Under "process" nothing is fsynced."""
    import sqlite3

    def mode(ledger: Ledger) -> int:
        conn: sqlite3.Connection = ledger.backend._w  # type: ignore[attr-defined]
        return int(conn.execute("PRAGMA synchronous").fetchone()[0])

    normal = 1
    db = tmp_path / "l.db"
    url = f"sqlite+aiosqlite:///{db}"
    synced: list[tuple[str, int]] = []  # (file, events committed when it was fsynced)
    real_fdatasync = os.fdatasync

    def spy(fd: int) -> None:
        with sqlite3.connect(db) as other:  # what another process sees: the commit is done
            stored = int(other.execute("SELECT count(*) FROM events").fetchone()[0])
        synced.append((Path(os.readlink(f"/proc/self/fd/{fd}")).name, stored))
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", spy)
    async with Ledger.open(url) as ledger:
        assert mode(ledger) == normal
        await ledger.append("call.sent", call_id="a", data=SENT, durable=False)
        assert synced == []
        await ledger.append("call.sent", call_id="b", data=SENT)
        assert synced == [("l.db-wal", 2)]
        await ledger.append("call.sent", call_id="c", data=SENT, durable=False)
        assert mode(ledger) == normal
        assert synced == [("l.db-wal", 2)]
        await ledger.aclose()
        assert synced == [("l.db-wal", 2), ("l.db-wal", 3)]
    synced.clear()
    async with Ledger.open(url) as ledger:
        await ledger.append("call.sent", call_id="d", data=SENT)
    assert synced == [("l.db-wal", 4)]  # the last commit was durable: nothing left for the close
    synced.clear()
    async with Ledger.open(url, durability="process") as ledger:
        await ledger.append("call.sent", call_id="e", data=SENT)
        await ledger.append("call.sent", call_id="f", data=SENT, durable=False)
        assert mode(ledger) == normal
    assert synced == []
    assert (await replay_url(url)).events == 6
