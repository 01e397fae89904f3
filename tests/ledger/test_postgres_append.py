"""The PostgreSQL append as one statement (ledger/postgres.py): committed when it returns, the
write-behind setting confined to its own transaction, the projection written with the events or
not at all, and a row slipped in by another session fences the writer."""

from __future__ import annotations

import random
import uuid
from typing import Any

import anyio
import asyncpg
import pytest

from quiesce.ledger import AppendItem, FencedError, Ledger, LedgerError, replay_url
from quiesce.tools.pgtemp import TempPostgres
from tests.ledger.helpers import COORDINATOR, REPLIED, SENT, random_items, raw_sql, started

pytestmark = pytest.mark.anyio


@pytest.fixture
def pg_url(postgres: TempPostgres) -> str:
    return postgres.create_database(f"t_{uuid.uuid4().hex[:20]}")


_WAITING_FOR_A_TRANSACTION = (
    "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = 'transactionid'"
)


async def _writer_state(url: str) -> list[tuple[object, ...]]:
    """The state of every other session on this database: the writer's, seen from outside."""
    return await raw_sql(
        url,
        "SELECT state FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        " AND backend_type = 'client backend'",
    )


async def test_each_append_is_committed_and_leaves_no_transaction_open(pg_url: str) -> None:
    async with Ledger.open(pg_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        behind = await ledger.append(
            "call.sent", checkpoint_id="c1", server="agent", call_id="k1", data=SENT, durable=False
        )
        # committed: another session sees it at once (it changes no projection row: counted later)
        assert await raw_sql(pg_url, f"SELECT kind FROM events WHERE seq = {behind.seq}") == [("call.sent",)]
        assert await raw_sql(pg_url, "SELECT calls, last_seq FROM attempts WHERE checkpoint_id = 'c1'") == [
            (0, behind.seq - 1)
        ]
        row = await ledger.attempt("c1")
        assert row is not None
        assert row.calls == 1
        # no session of the writer is left inside a transaction
        states = await _writer_state(pg_url)
        assert states
        assert all(state == ("idle",) for state in states), states
        await ledger.append("call.replied", checkpoint_id="c1", server="agent", call_id="k1", data=REPLIED)
        assert (await raw_sql(pg_url, "SELECT count(*) FROM events"))[0] == (4,)


async def test_write_behind_turns_synchronous_commit_off_for_its_transaction_only(pg_url: str) -> None:
    """The setting is in force while the rows go in (a test trigger records what each row's
    transaction sees), for single and batched write-behind statements, and does not outlive them."""
    async with Ledger.open(pg_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await raw_sql(
            pg_url,
            "CREATE TABLE seen_setting (seq BIGINT, synchronous_commit TEXT)",
            "CREATE FUNCTION record_setting() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            " INSERT INTO seen_setting VALUES (NEW.seq, current_setting('synchronous_commit')); RETURN NEW;"
            " END; $$",
            "CREATE TRIGGER record_setting AFTER INSERT ON events FOR EACH ROW"
            " EXECUTE FUNCTION record_setting()",
        )
        conn = await ledger._backend._asyncpg()  # type: ignore[attr-defined]  # the writer's own session
        await conn.execute("SET synchronous_commit = on")  # the test cluster's default is off
        durable = await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        behind = await ledger.append(
            "call.sent", checkpoint_id="c1", server="agent", call_id="k1", data=SENT, durable=False
        )
        batch = await ledger.append_many(
            [
                AppendItem("call.replied", checkpoint_id="c1", server="agent", call_id="k1", data=REPLIED),
                AppendItem("call.sent", checkpoint_id="c1", server="agent", call_id="k2", data=SENT),
            ],
            durable=False,
        )
        after = await ledger.append(
            "call.replied", checkpoint_id="c1", server="agent", call_id="k2", data=REPLIED
        )
        assert await conn.fetchval("SHOW synchronous_commit") == "on"
    seen = dict(await raw_sql(pg_url, "SELECT seq, synchronous_commit FROM seen_setting"))
    assert seen[durable.seq] == "on"
    assert seen[behind.seq] == "off"
    assert [seen[event.seq] for event in batch] == ["off", "off"]
    assert seen[after.seq] == "on"


async def test_a_row_slipped_in_by_another_session_fences_and_writes_nothing(pg_url: str) -> None:
    async with Ledger.open(pg_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        first = await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        # another session appends the next link of the chain behind the writer's back
        await raw_sql(
            pg_url,
            "INSERT INTO events (seq, at, kind, checkpoint_id, server, call_id, epoch, data, prev_hash, hash)"
            f" VALUES ({first.seq + 1}, '2025-01-01T00:00:00.000000Z', 'note', NULL, NULL, NULL, 1, '{{}}',"
            f" '{first.hash}', '{'f' * 64}')",
        )
        with pytest.raises(FencedError, match=f"head is seq {first.seq + 1}"):
            await ledger.append("call.sent", checkpoint_id="c1", server="agent", call_id="k1", data=SENT)
    # the projection did not count the refused call
    assert await raw_sql(pg_url, "SELECT calls FROM attempts WHERE checkpoint_id = 'c1'") == [(0,)]
    assert (await raw_sql(pg_url, "SELECT count(*) FROM events"))[0] == (3,)


async def test_every_statement_shape_writes_the_projection_replay_rebuilds(pg_url: str) -> None:
    """Single appends (one row, with and without a projection row) and batches (many rows; one or
    several projection rows — recovery.completed touches several ids) use different statements:
    whatever the mix, the stored projection equals the one replay folds from the events."""
    rng = random.Random(7)
    items = random_items(rng, 400)
    async with Ledger.open(pg_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        i = 0
        while i < len(items):
            size = rng.choice([1, 1, 1, 2, 5])
            chunk = items[i : i + size]
            i += size
            if size == 1:
                one = chunk[0]
                await ledger.append(
                    one.kind, checkpoint_id=one.checkpoint_id, server=one.server, call_id=one.call_id,
                    data=one.data, durable=rng.random() < 0.5,
                )  # fmt: skip
            else:
                await ledger.append_many(chunk, durable=rng.random() < 0.5)
    kinds = {item.kind for item in items}
    assert {"call.sent", "call.replied", "recovery.completed", "attempt.started"} <= kinds
    report = await replay_url(pg_url)
    assert report.ok, report.problem
    assert report.events == len(items) + 1
    assert (await raw_sql(pg_url, "SELECT count(*) FROM attempts"))[0][0] > 0


@pytest.mark.parametrize("rogue_commits", [True, False], ids=["commits", "rolls-back"])
async def test_an_append_racing_another_sessions_row_at_the_same_seq_commits_only_in_order(
    pg_url: str, rogue_commits: bool
) -> None:
    """No lock is taken per append: another session's row at the writer's next seq, not yet
    committed, passes the writer's insert-at-head check (it sees committed rows only), so the
    writer's statement waits on the seq key for that session's outcome. If it commits, the append
    is refused and fences — never a second row at a seq, never a row committed ahead of the one
    before it; if it rolls back, the append goes in at that seq as if nothing happened."""
    import asyncpg

    async with Ledger.open(pg_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        first = await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        rogue = await asyncpg.connect(pg_url.replace("postgresql+asyncpg://", "postgresql://"))
        outcome: list[BaseException] = []
        try:
            transaction = rogue.transaction()
            await transaction.start()
            await rogue.execute(
                "INSERT INTO events (seq, at, kind, checkpoint_id, server, call_id, epoch, data, prev_hash,"
                " hash) VALUES ($1, '2025-01-01T00:00:00.000000Z', 'note', NULL, NULL, NULL, 1, '{}',"
                " $2, $3)",
                first.seq + 1,
                first.hash,
                "f" * 64,
            )

            async def append() -> None:
                try:
                    await ledger.append(
                        "call.sent", checkpoint_id="c1", server="agent", call_id="k1", data=SENT
                    )
                except BaseException as error:
                    outcome.append(error)

            async with anyio.create_task_group() as tg:
                tg.start_soon(append)
                for _ in range(3000):  # the writer's statement waits for the rogue transaction
                    if await raw_sql(pg_url, _WAITING_FOR_A_TRANSACTION):
                        break
                    await anyio.sleep(0.02)
                else:
                    pytest.fail("the append never waited for the other session's row")
                await (transaction.commit() if rogue_commits else transaction.rollback())
        finally:
            await rogue.close()
        if rogue_commits:
            assert len(outcome) == 1
            assert isinstance(outcome[0], FencedError), outcome[0]
        else:
            assert outcome == []
            await ledger.append(
                "call.replied", checkpoint_id="c1", server="agent", call_id="k1", data=REPLIED
            )
    rows = await raw_sql(pg_url, "SELECT seq, kind FROM events ORDER BY seq")
    if rogue_commits:
        assert rows[-1] == (first.seq + 1, "note")
        assert await raw_sql(pg_url, "SELECT calls FROM attempts WHERE checkpoint_id = 'c1'") == [(0,)]
    else:
        assert rows[-2:] == [(first.seq + 1, "call.sent"), (first.seq + 2, "call.replied")]
        assert await raw_sql(pg_url, "SELECT calls, last_seq FROM attempts WHERE checkpoint_id = 'c1'") == [
            (0, first.seq)  # neither the call.sent nor its reply changes the row: counted later
        ]
        assert (await replay_url(pg_url)).ok


async def test_a_sync_whose_session_died_fails_clearly_and_the_next_one_opens_another(pg_url: str) -> None:
    """``sync`` runs on a session of its own: when the server ends it, that sync says so (the
    commits it was to flush stay owed) and the next sync flushes them on a new session."""
    async with Ledger.open(pg_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        await ledger.append(
            "call.sent", checkpoint_id="c1", server="a", call_id="k1", data=SENT, durable=False
        )
        await ledger.sync()
        driver = ledger.backend._sync_driver  # type: ignore[attr-defined]
        pid = driver.get_server_pid()
        assert pid != ledger.backend.writer_pid  # type: ignore[attr-defined]
        await raw_sql(pg_url, f"SELECT pg_terminate_backend({int(pid)})")
        await ledger.append(
            "call.sent", checkpoint_id="c1", server="a", call_id="k2", data=SENT, durable=False
        )
        with pytest.raises(LedgerError, match="making the last commits durable failed"):
            await ledger.sync()
        await ledger.sync()  # still owed: a new session flushes it
        assert ledger.backend._sync_driver.get_server_pid() != pid  # type: ignore[attr-defined]
        await ledger.sync()  # nothing owed now
    assert (await replay_url(pg_url)).ok


class _RefusedByAsyncpg:
    """The sync session's driver connection, whose next statement asyncpg's own state machine
    refuses (as it does when the server's end of the session reached it while idle)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    async def execute(self, *args: object, **kwargs: object) -> None:
        raise asyncpg.InternalClientError("cannot switch to state 15; another operation (2) is in progress")


async def test_a_sync_refused_by_asyncpgs_own_state_machine_fails_clearly_too(pg_url: str) -> None:
    """The race the test above can meet: the server's end of the session reaches asyncpg while it
    sits idle, and the next statement is refused by asyncpg's own state machine
    (``InternalClientError``) instead of a connection error. That too is a lost session: the same
    clear ``LedgerError``, the commits stay owed, and the next sync flushes them on a new session.
    (The refusal is forced here — it depends on timing — in front of a real session of a real server.)"""
    async with Ledger.open(pg_url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        await ledger.append(
            "call.sent", checkpoint_id="c1", server="a", call_id="k0", data=SENT, durable=False
        )
        await ledger.sync()  # opens the sync session
        backend: Any = ledger.backend
        pid = backend._sync_driver.get_server_pid()
        backend._sync_driver = _RefusedByAsyncpg(backend._sync_driver)
        await ledger.append(
            "call.sent", checkpoint_id="c1", server="a", call_id="k1", data=SENT, durable=False
        )
        with pytest.raises(LedgerError, match="making the last commits durable failed: cannot switch"):
            await ledger.sync()
        await ledger.sync()  # still owed: a new session flushes it
        assert backend._sync_driver.get_server_pid() != pid
    assert (await replay_url(pg_url)).ok
