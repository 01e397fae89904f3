"""Replay's fast paths give the verdict of the plain definition: page checks (``quiesce.ledger.chain``),
the reduced fold (``FoldFeed``), and seq ranges checked by worker processes (SQLite)."""

from __future__ import annotations

import hashlib
import json
import random
import sqlite3
import sys
from functools import partial
from json.encoder import encode_basestring
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quiesce.ledger import (
    GENESIS_HASH,
    AppendItem,
    Event,
    Ledger,
    LedgerError,
    chain_hash,
    fold_events,
    restore_triggers,
    row_bytes,
)
from quiesce.ledger import replay_worker as worker_module
from quiesce.ledger.canonical import canonical
from quiesce.ledger.chain import _check_exact, _escapes, check_rows
from quiesce.ledger.layout import EVENT_COLUMNS
from quiesce.ledger.projections import (
    KEYS_READ_BY_FOLD,
    KINDS_READ_BY_FOLD,
    AttemptRow,
    FoldFeed,
    FoldItem,
    fold_items,
)
from quiesce.ledger.replay import ReplayReport, replay_url
from tests.ledger.helpers import COORDINATOR, drop_triggers_sql, random_items, raw_sql, sqlite_path

Row = tuple[Any, ...]


def _rows(items: list[AppendItem], *, server: str | None = None) -> list[Row]:
    """Stored rows for ``items`` with a sound chain (``server`` overrides every server column)."""
    rows: list[Row] = []
    prev = GENESIS_HASH
    for seq, item in enumerate(items, start=1):
        text = canonical(item.data).decode()
        at = f"2025-01-01T00:00:{seq // 1000:02d}.{seq:06d}Z"
        srv = server if server is not None else item.server
        epoch = 1 + seq // 500
        digest = chain_hash(
            prev,
            row_bytes(seq=seq, at=at, kind=item.kind, checkpoint_id=item.checkpoint_id, server=srv,
                      call_id=item.call_id, epoch=epoch, data_text=text, prev_hash=prev),
        )  # fmt: skip
        rows.append((seq, at, item.kind, item.checkpoint_id, srv, item.call_id, epoch, text, prev, digest))
        prev = digest
    return rows


def _rehash(row: Row, **columns: Any) -> Row:
    """``row`` with ``columns`` changed and its hash recomputed the way a careless forger would:
    by splicing the columns as they are, without the canonical encoding."""
    names = ("seq", "at", "kind", "cid", "server", "call_id", "epoch", "data", "prev", "hash")
    values = dict(zip(names, row, strict=True))
    values.update(columns)
    q = '"'

    def text(v: Any) -> str:
        return "null" if v is None else q + str(v) + q

    body = (
        f'{{"at":{text(values["at"])},"call_id":{text(values["call_id"])},'
        f'"checkpoint_id":{text(values["cid"])},"data":{values["data"]},"epoch":{values["epoch"]},'
        f'"kind":{text(values["kind"])},"prev_hash":"{values["prev"]}","seq":{values["seq"]},'
        f'"server":{text(values["server"])}}}'
    )
    values["hash"] = hashlib.sha256((values["prev"] + body).encode()).hexdigest()
    return tuple(values.values())


# -- page checks -------------------------------------------------------------------------------


def test_page_check_agrees_with_the_definition_on_sound_and_awkward_rows() -> None:
    rng = random.Random(7)
    items = random_items(rng, 300)
    for server in (None, 's"1', "s\\1", "s\n1", "sé\u2028"):
        rows = _rows(items, server=server)
        assert _check_exact(rows, (0, GENESIS_HASH)) is None
        for start in (0, 1, 150, 299):
            after = (0, GENESIS_HASH) if start == 0 else (rows[start - 1][0], rows[start - 1][9])
            assert check_rows(rows[start:], after) is None
            assert check_rows(rows[start:], None) is None


def _relinked(rows: list[Row], start: int) -> list[Row]:
    """``rows`` with every row from ``start`` on linked to the one before and hashed canonically:
    a forger who rewrote the rest of the chain."""
    out = rows[:start]
    for seq, at, kind, cid, server, call_id, epoch, text, _, _ in rows[start:]:
        prev = out[-1][9] if out else GENESIS_HASH
        digest = chain_hash(
            prev,
            row_bytes(seq=seq, at=at, kind=kind, checkpoint_id=cid, server=server, call_id=call_id,
                      epoch=epoch, data_text=text, prev_hash=prev),
        )  # fmt: skip
        out.append((seq, at, kind, cid, server, call_id, epoch, text, prev, digest))
    return out


@pytest.mark.parametrize(
    "change",
    [
        {"epoch": 1.0},  # a float where the canonical row has an int
        {"epoch": 2.5},
        {"at": 20250101},
        {"at": b"2025-01-01T00:00:00.000001Z"},
        {"server": 's","call_id":"x'},  # a quote spliced in instead of escaped
        {"cid": "c\\1"},
        {"kind": "call.sent\n"},
        {"call_id": "k\u0001"},
        {"at": "2025-01-01T00:00:00.000021Z\x1f"},
        {"server": "\x00"},
    ],
)
def test_a_row_hashed_without_the_canonical_encoding_is_refused(change: dict[str, Any]) -> None:
    """The fast path splices columns as they are: it must not accept a hash made that way, even
    with the rest of the chain rewritten to follow it."""
    rows = _rows(random_items(random.Random(3), 40))
    rows[20] = _rehash(rows[20], **change)
    rows = _relinked(rows, 21)
    expected = _check_exact(rows, (0, GENESIS_HASH))
    assert expected is not None
    assert expected[0] == 21
    assert _check_exact(rows[21:], (rows[20][0], rows[20][9])) is None, "only row 21 is wrong"
    assert check_rows(rows, (0, GENESIS_HASH)) == expected
    assert check_rows(rows[15:], None) == expected
    assert check_rows(rows[20:], None) == expected
    assert check_rows(rows[20:21], None) == expected


@given(
    cut=st.integers(0, 59),
    victim=st.integers(0, 59),
    how=st.sampled_from(["data", "hash", "prev", "drop", "swap", "at", "kind"]),
)
@settings(max_examples=150, deadline=None)
def test_page_check_names_the_same_problem_as_the_definition(cut: int, victim: int, how: str) -> None:
    rows = _rows(random_items(random.Random(11), 60))
    row = list(rows[victim])
    if how == "drop":
        del rows[victim]
    elif how == "swap" and victim + 1 < len(rows):
        rows[victim], rows[victim + 1] = rows[victim + 1], rows[victim]
    else:
        column = {"data": 7, "hash": 9, "prev": 8, "at": 1, "kind": 2}.get(how, 7)
        row[column] = row[column][:-2] + ("0" if column in (8, 9) else "x") + row[column][-1]
        rows[victim] = tuple(row)
    expected = _check_exact(rows, (0, GENESIS_HASH))
    first = check_rows(rows[:cut], (0, GENESIS_HASH))
    second = check_rows(rows[cut:], (rows[cut - 1][0], rows[cut - 1][9]) if cut else (0, GENESIS_HASH))
    assert (first or second) == expected


def test_escapes_names_exactly_the_characters_the_canonical_encoding_escapes() -> None:
    """The fast path splices only text ``_escapes`` passes: every code point is checked against
    the encoder itself, alone and inside other text."""
    for code in range(0x110000):
        char = chr(code)
        if 0xD800 <= code <= 0xDFFF:  # no UTF-8 encoding: the page goes to the definition
            with pytest.raises(UnicodeEncodeError, match="surrogates not allowed"):
                _escapes(char)
            continue
        escaped = encode_basestring(char) != f'"{char}"'
        assert _escapes(char) == escaped, hex(code)
        assert _escapes(f"aé{char}\u2028z") == escaped, hex(code)


def test_text_without_utf8_encoding_gets_the_verdict_of_the_definition() -> None:
    rows = _rows(random_items(random.Random(4), 30))
    rows[12] = (rows[12][0], rows[12][1] + "\ud800", *rows[12][2:])
    expected = _check_exact(rows, (0, GENESIS_HASH))
    assert expected is not None
    assert expected[0] == 13
    assert "cannot be hashed" in expected[1]
    assert check_rows(rows, (0, GENESIS_HASH)) == expected
    assert check_rows(rows[10:], None) == expected


# -- the reduced fold --------------------------------------------------------------------------


def _decoded(text: Any) -> dict[str, Any]:
    """The payload replay reads from a stored text: the JSON object it holds, else ``{}``."""
    try:
        value = json.loads(text)
    except (ValueError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}


def _naive(rows: list[Row]) -> dict[str, AttemptRow]:
    """The definition: ``fold_events`` over every stored row as a whole ``Event``."""
    return fold_events(
        Event(seq, at, kind, cid, server, call_id, epoch, _decoded(text), prev, digest)
        for seq, at, kind, cid, server, call_id, epoch, text, prev, digest in rows
    )


#: Stored payload texts a forger (or a bug) could leave, for the kinds whose payload fold reads.
ODD_PAYLOADS: list[Any] = [
    "[1]",
    "not json",
    "",
    "5",
    "null",
    '{"phase":7,"kind":["x"],"participants":"ab","deadline_ts":"soon","outcome":null,"outcomes":["c"]}',
    '{"participants":[1,null,"s"],"deadline_ts":true,"kind":3,"outcome":0,"phase":{"a":1}}',
    '{"outcomes":{"ckpt-00001":"abandoned","ckpt-00002":7,"nobody":"abandoned"},"extra":[1,2]}',
    '{"outcomes":{}}',
    "{}",
    17,
]


def _odd(rows: list[Row], rng: random.Random) -> list[Row]:
    """``rows`` with odd payloads, odd columns and repeated starts spliced in, and the whole chain
    rehashed (a forger who rewrote it)."""
    out = list(rows)
    for index in rng.sample(range(len(out)), len(out) // 20):
        seq, at, kind, cid, server, call_id, epoch, text, prev, digest = out[index]
        roll = rng.random()
        if roll < 0.6:
            kind = rng.choice(sorted(KINDS_READ_BY_FOLD))
            text = rng.choice(ODD_PAYLOADS)
        elif roll < 0.75:
            cid = None
        elif roll < 0.9:
            kind, text = "attempt.started", canonical({"kind": "save", "participants": ["again"]}).decode()
        else:
            kind = "kind.unknown"
        out[index] = (seq, at, kind, cid, server, call_id, epoch, text, prev, digest)
    return _relinked(out, 0)


def _only_what_fold_reads(items: list[FoldItem]) -> None:
    for item in items:
        if len(item) == 2:
            cid, n = item
            assert isinstance(cid, str)
            assert n >= 1
            continue
        seq, at, kind, cid, epoch, payload = item
        assert isinstance(seq, int)
        assert isinstance(at, str)
        assert isinstance(epoch, int)
        assert kind != "call.sent"
        assert cid is not None or kind == "recovery.completed"
        if kind in KINDS_READ_BY_FOLD:
            assert isinstance(payload, dict)
            assert set(payload) <= set(KEYS_READ_BY_FOLD[kind])
        else:
            assert payload is None


@pytest.mark.parametrize(
    ("seed", "odd"), [(1, False), (2, False), (3, False), (4, True), (5, True), (6, True)]
)
def test_fold_feed_gives_the_rows_of_fold_over_every_event(seed: int, odd: bool) -> None:
    """The items (reduced to what fold reads, payloads decoded once) fold to the rows of ``fold``
    over every whole event — on odd ledgers too: payloads that are no object or hold odd values,
    events without their checkpoint id, repeated starts, unknown kinds."""
    rng = random.Random(seed)
    rows = _rows(random_items(rng, 4000))
    if odd:
        rows = _odd(rows, rng)
        assert check_rows(rows, (0, GENESIS_HASH)) is None
    expected = _naive(rows)
    assert len(expected) > 50
    # in one go; page by page; and as chunks reduced separately then folded in order
    whole: dict[str, AttemptRow] = {}
    feed = FoldFeed()
    feed.add(rows)
    items = feed.take()
    _only_what_fold_reads(items)
    fold_items(whole, items, {})
    assert whole == expected
    cuts = sorted(rng.sample(range(1, len(rows)), 40))
    paged: dict[str, AttemptRow] = {}
    paged_sent: dict[str, int] = {}
    chunked = []
    for a, b in zip([0, *cuts], [*cuts, len(rows)], strict=True):
        feed.add(rows[a:b])
        fold_items(paged, feed.take(), paged_sent)
        part = FoldFeed()
        part.add(rows[a:b])
        chunked.append(part.take())
    assert paged == expected
    rebuilt: dict[str, AttemptRow] = {}
    sent: dict[str, int] = {}
    for items in chunked:
        fold_items(rebuilt, items, sent)
    assert rebuilt == expected


# -- worker processes (SQLite) -----------------------------------------------------------------


def _fill(url: str, n: int, seed: int = 5) -> None:
    async def go() -> None:
        rng = random.Random(seed)
        async with Ledger.open(url, durability="process") as ledger:
            await ledger.start_epoch(COORDINATOR)
            items = random_items(rng, n - 1)
            for start in range(0, len(items), 37):
                await ledger.append_many(items[start : start + 37])

    anyio.run(go)


def _both(url: str, chunk_events: int = 7) -> tuple[ReplayReport, ReplayReport]:
    async def go() -> tuple[ReplayReport, ReplayReport]:
        single = await replay_url(url, workers=0)
        parallel = await replay_url(url, workers=2, chunk_events=chunk_events)
        return single, parallel

    return anyio.run(go)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"


def test_workers_agree_with_one_pass_on_a_sound_ledger(sqlite_url: str) -> None:
    _fill(sqlite_url, 500)
    for chunk_events in (1, 7, 64, 499, 500, 10_000):
        single, parallel = _both(sqlite_url, chunk_events)
        assert single.ok, single.differences[:3]
        assert parallel.to_json() == single.to_json()
        assert parallel.events == 500
        assert (single.workers, parallel.workers) == (0, min(2, -(-500 // chunk_events)))


# Chunks of 7 seqs: (0, 7], (7, 14], (14, 21], ... — 15 starts a chunk, 14 ends one, 17 is inside.
TAMPERS = {
    "edited inside a chunk": ["UPDATE events SET data = data || ' ' WHERE seq = 17"],
    "edited first row of a chunk": ["UPDATE events SET at = 'x' || at WHERE seq = 15"],
    "edited last row of a chunk": ["UPDATE events SET epoch = epoch + 1 WHERE seq = 14"],
    "edited first row": ["UPDATE events SET kind = 'call.sent' WHERE seq = 1"],
    "link broken at a boundary": ["UPDATE events SET prev_hash = hash WHERE seq = 15"],
    "link broken inside a chunk": ["UPDATE events SET prev_hash = hash WHERE seq = 18"],
    "hash rewritten at a chunk end": ["UPDATE events SET hash = prev_hash WHERE seq = 14"],
    "deleted inside a chunk": ["DELETE FROM events WHERE seq = 17"],
    "deleted first row of a chunk": ["DELETE FROM events WHERE seq = 15"],
    "deleted last row of a chunk": ["DELETE FROM events WHERE seq = 14"],
    "deleted a whole chunk": ["DELETE FROM events WHERE seq BETWEEN 15 AND 21"],
    "deleted across chunks": ["DELETE FROM events WHERE seq BETWEEN 12 AND 30"],
    "deleted first row": ["DELETE FROM events WHERE seq = 1"],
    "seq 0 inserted": [
        "INSERT INTO events SELECT 0, at, kind, checkpoint_id, server, call_id, epoch, data, prev_hash, hash "
        "FROM events WHERE seq = 1"
    ],
    "two problems, the earlier wins": [
        "UPDATE events SET data = data || ' ' WHERE seq = 40",
        "DELETE FROM events WHERE seq = 23",
    ],
}


@pytest.mark.parametrize("tamper", list(TAMPERS))
def test_workers_name_the_first_bad_seq_as_one_pass_does(sqlite_url: str, tamper: str) -> None:
    _fill(sqlite_url, 80)
    anyio.run(lambda: raw_sql(sqlite_url, *drop_triggers_sql(sqlite_url), *TAMPERS[tamper]))
    single, parallel = _both(sqlite_url)
    assert not single.chain_ok
    assert parallel.to_json() == single.to_json()


def test_named_problems_at_chunk_boundaries(sqlite_url: str) -> None:
    _fill(sqlite_url, 80)
    expected = {
        "edited first row of a chunk": (15, "hash mismatch"),
        "link broken at a boundary": (15, "prev_hash does not match"),
        "deleted first row of a chunk": (15, "seq 15 missing"),
        "deleted last row of a chunk": (14, "seq 14 missing"),
        "deleted a whole chunk": (15, "seq 15..21 missing (rows deleted); next seq is 22"),
    }
    for index, (tamper, (seq, text)) in enumerate(expected.items()):
        copy = sqlite_url.replace("ledger.db", f"copy-{index}.db")
        Path(copy.removeprefix("sqlite+aiosqlite:///")).write_bytes(
            Path(sqlite_url.removeprefix("sqlite+aiosqlite:///")).read_bytes()
        )
        anyio.run(partial(raw_sql, copy, *drop_triggers_sql(copy), *TAMPERS[tamper]))
        _, parallel = _both(copy)
        assert parallel.first_bad_seq == seq, tamper
        assert parallel.problem is not None
        assert text in parallel.problem, tamper


def test_workers_rebuild_the_live_projection(sqlite_url: str) -> None:
    _fill(sqlite_url, 3000, seed=9)

    async def go() -> None:
        report = await replay_url(sqlite_url, workers=2, chunk_events=211)
        assert report.ok, report.differences[:3]
        await raw_sql(sqlite_url, "UPDATE attempts SET calls = calls + 1")
        damaged = await replay_url(sqlite_url, workers=2, chunk_events=211)
        assert not damaged.projections_ok
        rebuilt = await replay_url(sqlite_url, rebuild=True, workers=2, chunk_events=211)
        assert rebuilt.rebuilt
        assert (await replay_url(sqlite_url, workers=2, chunk_events=211)).ok

    anyio.run(go)


def _forge(url: str, rng: random.Random) -> list[Row]:
    """Splice odd rows into the ledger at ``url`` (``_odd``: triggers dropped, chain rehashed, the
    projection left as written); the stored rows after it."""
    conn = sqlite3.connect(sqlite_path(url))
    try:
        for statement in drop_triggers_sql(url):
            conn.execute(statement)
        select = f"SELECT {', '.join(EVENT_COLUMNS)} FROM events ORDER BY seq"
        forged = _odd(conn.execute(select).fetchall(), rng)
        conn.executemany(
            "UPDATE events SET kind = ?, checkpoint_id = ?, data = ?, prev_hash = ?, hash = ? WHERE seq = ?",
            [
                (kind, cid, text, prev, digest, seq)
                for seq, _, kind, cid, _, _, _, text, prev, digest in forged
            ],
        )
        conn.commit()
        stored: list[Row] = conn.execute(select).fetchall()
    finally:
        conn.close()
    return stored


def test_workers_rebuild_what_fold_over_every_event_gives_on_an_odd_ledger(sqlite_url: str) -> None:
    """A forger rewrote payloads (no objects, odd values), dropped checkpoint ids and repeated
    starts, and rehashed the chain: the chain holds, and the rows the workers rebuild are those of
    ``fold`` over every whole stored event, as one pass in this process finds them."""
    _fill(sqlite_url, 3000, seed=12)
    rows = _forge(sqlite_url, random.Random(12))
    assert check_rows(rows, (0, GENESIS_HASH)) is None
    expected = _naive(rows)

    async def go() -> None:
        single = await replay_url(sqlite_url, workers=0)
        parallel = await replay_url(sqlite_url, workers=2, chunk_events=97)
        assert single.chain_ok
        assert not single.projections_ok, "the live projection holds the rows of the events as written"
        assert parallel.to_json() == single.to_json()
        with pytest.raises(LedgerError, match="append-only triggers"):  # the forger dropped them
            await replay_url(sqlite_url, rebuild=True, workers=2, chunk_events=97)
        await restore_triggers(sqlite_url)  # `quiesce db upgrade`, as the refusal says
        assert (await replay_url(sqlite_url, rebuild=True, workers=2, chunk_events=97)).rebuilt
        async with Ledger.open(sqlite_url, readonly=True) as ledger:
            live = await ledger.attempts(stored=True)
        assert {row.checkpoint_id: row for row in live} == expected
        assert (await replay_url(sqlite_url, workers=2, chunk_events=97)).ok

    anyio.run(go)


def test_a_worker_that_dies_is_an_error(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _fill(sqlite_url, 30)
    monkeypatch.setattr(worker_module, "command", lambda path: [sys.executable, "-c", "pass"])
    with pytest.raises(LedgerError, match="ended without answering"):
        anyio.run(lambda: replay_url(sqlite_url, workers=2, chunk_events=7))


def test_a_worker_error_is_reported(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _fill(sqlite_url, 30)
    real = worker_module.command
    monkeypatch.setattr(worker_module, "command", lambda path: real(path.with_name("missing.db")))
    with pytest.raises(LedgerError, match="replay worker failed"):
        anyio.run(lambda: replay_url(sqlite_url, workers=2, chunk_events=7))
