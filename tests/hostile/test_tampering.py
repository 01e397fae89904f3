"""Ledger tampering: for each way of editing a ledger behind quiesce's back, who finds it, at which seq.

A tamperer with the file (SQLite) first drops the append-only triggers, then edits. The ledger
holds 400 events (more than the `TAIL_ROWS` a writer's open verifies), and a whole-ledger audit
bundle was exported before the tampering (except where the case says there is none). Four
finders are asked, each for the seq it names (None: it finds nothing):

- `open`: a writer's open (`Ledger.connect`, what every coordinator does) — it verifies the end of
  the chain only, so an old edit is not its to find, and it refuses what it finds;
- `replay`: `quiesce replay --verify` (the whole chain, plus rows removed from the end);
- `check`: `quiesce check` (the protocol check and the whole chain, in one pass);
- `bundle`: `quiesce verify-bundle BUNDLE --ledger URL` with the bundle exported before.

A consistent rewrite (edit, then every later hash recomputed) is invisible to anything that has
only the ledger; the bundle kept elsewhere is what finds it. That is the case's honest answer.
"""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from quiesce.ledger import BrokenChainError, Ledger, chain_hash, replay_url, restore_triggers, row_bytes
from quiesce.ledger.store import TAIL_ROWS
from quiesce.tools.audit.bundle import verify_bundle
from quiesce.tools.audit.cli import check_ledger
from quiesce.tools.audit.source import cross_check, export_bundle
from tests.hostile.helpers import no_traceback, run_cli
from tests.ledger.helpers import COORDINATOR, random_items

EVENTS = 400
RECENT = 300  # within the last TAIL_ROWS rows: a writer's open sees it
OLD = 50  # before them: only the whole-chain audits see it
assert EVENTS - TAIL_ROWS < RECENT
assert OLD <= EVENTS - TAIL_ROWS

Tamper = Callable[[sqlite3.Connection], object]


TRIGGERS = ("events_no_update", "events_no_delete", "events_insert_at_head")


def _drop_triggers(db: sqlite3.Connection) -> None:
    for name in TRIGGERS:
        db.execute(f"DROP TRIGGER {name}")


def _edit(seq: int) -> Tamper:
    return lambda db: db.execute(
        "UPDATE events SET data = json_set(data, '$.tampered', 1) WHERE seq = ?", (seq,)
    )


def _delete(seq: int) -> Tamper:
    return lambda db: db.execute("DELETE FROM events WHERE seq = ?", (seq,))


def _truncate(first: int) -> Tamper:
    return lambda db: db.execute("DELETE FROM events WHERE seq >= ?", (first,))


def _reorder(seq: int) -> Tamper:
    def swap(db: sqlite3.Connection) -> None:
        db.execute("UPDATE events SET seq = -1 WHERE seq = ?", (seq,))
        db.execute("UPDATE events SET seq = ? WHERE seq = ?", (seq, seq + 1))
        db.execute("UPDATE events SET seq = ? WHERE seq = -1", (seq + 1,))

    return swap


def _hash_only(seq: int) -> Tamper:
    return lambda db: db.execute("UPDATE events SET hash = ? WHERE seq = ?", ("ab" * 32, seq))


def _rechain(seq: int) -> Tamper:
    """Edit `seq`, then recompute the hash of it and of every later row: a consistent chain."""

    def rewrite(db: sqlite3.Connection) -> None:
        _edit(seq)(db)
        (prev,) = db.execute("SELECT hash FROM events WHERE seq = ?", (seq - 1,)).fetchone()
        rows = db.execute(
            "SELECT seq, at, kind, checkpoint_id, server, call_id, epoch, data FROM events WHERE seq >= ?"
            " ORDER BY seq",
            (seq,),
        ).fetchall()
        for s, at, kind, cid, server, call_id, epoch, data in rows:
            digest = chain_hash(
                prev,
                row_bytes(seq=s, at=at, kind=kind, checkpoint_id=cid, server=server, call_id=call_id,
                          epoch=epoch, data_text=data, prev_hash=prev),
            )  # fmt: skip
            db.execute("UPDATE events SET prev_hash = ?, hash = ? WHERE seq = ?", (prev, digest, s))
            prev = digest

    return rewrite


def _replace(seq: int) -> Tamper:
    return lambda db: db.execute(
        "REPLACE INTO events SELECT seq, at, kind, checkpoint_id, server, call_id, epoch,"
        " json_set(data, '$.tampered', 1), prev_hash, hash FROM events WHERE seq = ?",
        (seq,),
    )


#: case -> (tamper, is there a bundle from before, {finder: seq it names or None})
CASES: dict[str, tuple[Tamper, bool, dict[str, int | None]]] = {
    "edit a recent row": (
        _edit(RECENT),
        True,
        {"open": RECENT, "replay": RECENT, "check": RECENT, "bundle": RECENT},
    ),
    "edit an old row": (_edit(OLD), True, {"open": None, "replay": OLD, "check": OLD, "bundle": OLD}),
    "delete a middle row": (
        _delete(RECENT),
        True,
        {"open": RECENT, "replay": RECENT, "check": RECENT, "bundle": RECENT},
    ),
    "truncate the tail, with a bundle": (
        _truncate(391),
        True,
        {"open": 391, "replay": 391, "check": 391, "bundle": 391},
    ),
    "truncate the tail, no bundle": (_truncate(391), False, {"open": 391, "replay": 391, "check": 391}),
    "reorder two rows": (
        _reorder(RECENT),
        True,
        {"open": RECENT, "replay": RECENT, "check": RECENT, "bundle": RECENT},
    ),
    "edit the hash only": (
        _hash_only(RECENT),
        True,
        {"open": RECENT, "replay": RECENT, "check": RECENT, "bundle": RECENT},
    ),
    "rechain after an edit": (
        _rechain(RECENT),
        True,
        {"open": None, "replay": None, "check": None, "bundle": RECENT},
    ),
    "REPLACE a row": (
        _replace(RECENT),
        True,
        {"open": RECENT, "replay": RECENT, "check": RECENT, "bundle": RECENT},
    ),
}


async def _fill(url: str) -> None:
    async with Ledger.open(url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.append_many(random_items(random.Random(20), EVENTS - 1))


async def _findings(url: str, bundle: Path | None) -> dict[str, int | None]:
    found: dict[str, int | None] = {}
    refused: BrokenChainError | None = None
    try:
        writer = await Ledger.connect(url)
    except BrokenChainError as error:
        refused = error
    else:
        await writer.aclose()
    found["open"] = refused.seq if refused is not None else None
    if refused is not None:
        assert f"quiesce replay --verify --ledger {url}" in str(refused)  # the command that shows where
        assert f"seq {refused.seq}" in str(refused)
    found["replay"] = (await replay_url(url)).first_bad_seq
    found["check"] = (await check_ledger(url)).chain.first_bad_seq
    if bundle is not None:
        result = await anyio.to_thread.run_sync(lambda: verify_bundle(bundle, keep_claims=True))
        assert result.problems == []  # the bundle itself is intact: it was exported before
        await cross_check(url, result)
        found["bundle"] = result.ledger_problems[0].seq if result.ledger_problems else None
    return found


@pytest.mark.anyio
@pytest.mark.parametrize("case", list(CASES))
async def test_who_finds_the_tampering_and_which_seq_they_name(case: str, tmp_path: Path) -> None:
    tamper, with_bundle, expected = CASES[case]
    path = tmp_path / "ledger.db"
    url = f"sqlite+aiosqlite:///{path}"
    await _fill(url)
    assert await _findings(url, None) == {"open": None, "replay": None, "check": None}  # sound to begin with
    bundle = tmp_path / "before.jsonl" if with_bundle else None
    if bundle is not None:
        await export_bundle(url, bundle, None)
    with sqlite3.connect(path) as db:
        _drop_triggers(db)
        tamper(db)
    assert await restore_triggers(url) == sorted(TRIGGERS)  # a careful tamperer puts them back
    assert await _findings(url, bundle) == expected


def test_the_database_refuses_replace_while_its_triggers_stand(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    anyio.run(_fill, f"sqlite+aiosqlite:///{path}")
    with sqlite3.connect(path) as db, pytest.raises(sqlite3.IntegrityError, match="append-only"):
        _replace(RECENT)(db)
    assert anyio.run(lambda: _findings(f"sqlite+aiosqlite:///{path}", None)) == {
        "open": None,
        "replay": None,
        "check": None,
    }


def test_the_commands_name_the_seq_and_no_coordinator_appends(tmp_path: Path) -> None:
    """Through the real CLI: `check` and `verify-bundle --ledger` exit 1 naming the seq; a coordinator
    refuses to open the ledger for writing (naming the command that shows where); nothing is appended."""
    path = tmp_path / "ledger.db"
    url = f"sqlite+aiosqlite:///{path}"
    anyio.run(_fill, url)
    bundle = tmp_path / "before.jsonl"
    anyio.run(export_bundle, url, bundle, None)
    with sqlite3.connect(path) as db:
        _drop_triggers(db)
        _edit(RECENT)(db)
    check = run_cli("check", "--ledger", url)
    assert check.returncode == 1
    assert f"BROKEN at seq {RECENT}" in check.stdout
    verify = run_cli("verify-bundle", str(bundle), "--ledger", url)
    assert verify.returncode == 1
    assert f"BAD seq {RECENT}: the ledger's row does not verify" in verify.stdout
    replay = run_cli("replay", "--verify", "--ledger", url)
    assert replay.returncode == 1
    assert f"BROKEN at seq {RECENT}" in replay.stdout
    config = tmp_path / "cluster.yaml"
    config.write_text(f"ledger: {url}\nservers:\n  - {{name: m, url: 'http://127.0.0.1:9'}}\n")
    recover = run_cli("recover", "--config", str(config))
    assert recover.returncode == 1, recover.stderr
    assert f"hash chain is broken at seq {RECENT}" in recover.stderr
    assert "quiesce replay --verify --ledger" in recover.stderr
    no_traceback(recover)
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT max(seq) FROM events").fetchone() == (EVENTS,)


@pytest.mark.anyio
async def test_a_projection_ahead_of_the_events_blocks_writers_until_an_explicit_rebuild(
    tmp_path: Path,
) -> None:
    """The events alone cannot tell rows removed from the end from an edited projection: a writer
    refuses, `replay --verify` names the seq after the head, and `replay --rebuild` — the operator's
    explicit call — replaces the projection from the events, after which writers open again."""
    path = tmp_path / "ledger.db"
    url = f"sqlite+aiosqlite:///{path}"
    await _fill(url)
    with sqlite3.connect(path) as db:
        (cid,) = db.execute("SELECT checkpoint_id FROM attempts LIMIT 1").fetchone()
        db.execute("UPDATE attempts SET last_seq = ? WHERE checkpoint_id = ?", (EVENTS + 7, cid))
    assert await _findings(url, None) == {"open": EVENTS + 1, "replay": EVENTS + 1, "check": EVENTS + 1}
    rebuilt = await replay_url(url, rebuild=True)
    assert rebuilt.rebuilt
    assert rebuilt.chain_ok
    assert await _findings(url, None) == {"open": None, "replay": None, "check": None}
