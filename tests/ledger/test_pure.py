"""Canonical encoding, the chain formula, redaction, capping and the projection fold: no database."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import hashlib
import json
import random
import sys
import uuid
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from quiesce.ledger import (
    BODY_CAP_BYTES,
    GENESIS_HASH,
    REDACTED,
    Event,
    chain_hash,
    fold,
    fold_events,
    row_bytes,
)
from quiesce.ledger.canonical import canonical, next_hash
from quiesce.ledger.events import KINDS, new_event
from quiesce.ledger.payloads import PAYLOADS
from quiesce.ledger.projections import (
    COLUMNS,
    KEYS_READ_BY_FOLD,
    KINDS_READ_BY_FOLD,
    AttemptRow,
    _row,
    payload_read_by_fold,
    replace,
    stored_values,
    to_columns,
    touched,
)
from quiesce.ledger.redact import Redactor, cap_bodies
from tests.ledger.helpers import random_items

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def test_canonical_is_sorted_compact_utf8() -> None:
    assert canonical({"b": 1, "a": [1.5, "é", None]}) == '{"a":[1.5,"é",null],"b":1}'.encode()
    with pytest.raises(ValueError, match="JSON compliant"):
        canonical({"x": float("nan")})


@given(
    value=json_values | st.integers() | st.tuples(st.text(), st.floats(allow_nan=False, allow_infinity=False))
)
@example(value={"a": 1e300, "b": -0.0, "c": 2**70, "d": '\u2028"\\\x01😀'})
def test_canonical_is_exactly_the_documented_json_dumps(value: Any) -> None:
    # the definition auditors reimplement (canonical.py's docstring), byte for byte
    documented = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    assert canonical(value) == documented.encode("utf-8")


def _documented(value: Any) -> bytes:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode()


@settings(max_examples=3000, deadline=None)
@given(number=st.floats(allow_nan=False, allow_infinity=False))
@example(number=1e16)
@example(number=9999999999999998.0)
@example(number=1e-4)
@example(number=9.999999999999999e-05)
@example(number=5e-324)
@example(number=-0.0)
@example(number=1.7976931348623157e308)
def test_canonical_writes_every_float_as_json_does(number: float) -> None:
    # orjson writes some floats otherwise (1e16, 0.00001): those must take json's path
    assert canonical(number) == _documented(number)
    assert canonical({"x": [number, {"y": number}]}) == _documented({"x": [number, {"y": number}]})


class _Colour(enum.Enum):
    RED = 1


class _Label(str):
    pass


@dataclasses.dataclass
class _Point:
    x: int


def test_canonical_takes_json_s_path_for_whatever_orjson_would_write_otherwise() -> None:
    """orjson writes dates, UUIDs, enums and dataclasses, which json refuses; sorts and writes str
    subclasses and tuples as json does only by chance; refuses lone surrogates and big ints:
    canonical() is json's answer for each, as before."""
    refused = [
        datetime.datetime(2026, 1, 2, tzinfo=datetime.UTC),
        uuid.UUID(int=1),
        _Colour.RED,
        _Point(1),
        {"a": float("nan")},
        {1: "x", "a": "y"},
    ]
    for value in refused:
        with pytest.raises((TypeError, ValueError)):
            json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        with pytest.raises((TypeError, ValueError)):
            canonical(value)
        with pytest.raises((TypeError, ValueError)):
            canonical({"nested": [value]})
    written = [(1, "a"), _Label("b"), {"k": _Label("v")}, {1: "x"}, {2.5: 1}, 2**64, -(2**63) - 1]
    written += [[[[[["deep"]]]]], True, None]
    for value in written:
        assert canonical(value) == _documented(value), value
    deep: Any = "x"
    for _ in range(300):  # deeper than orjson goes
        deep = {"d": deep}
    assert canonical(deep) == _documented(deep)
    with pytest.raises(UnicodeEncodeError):
        canonical({"s": "\ud800"})


def test_canonical_without_orjson_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process without orjson (the replay workers run ``python -S``) writes the same bytes."""
    from quiesce.ledger import canonical as module

    values = [{"b": 1.5, "a": ["é", None, 10**30, 1e16]}, "x", [0.1, -0.0]]
    before = [canonical(v) for v in values]
    monkeypatch.setattr(module, "_ORJSON_DUMPS", None)
    assert [canonical(v) for v in values] == before == [_documented(v) for v in values]
    assert [module.canonical_text_of_plain(v).encode() for v in values] == before


def test_canonical_refuses_what_json_dumps_refuses_and_is_not_left_broken_by_it() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    loop: dict[str, Any] = {"a": [1]}
    loop["a"].append({"b": loop})
    deep: list[Any] = []
    for _ in range(100_000):  # acyclic, nested deeper than any stack
        deep = [deep]
    for bad, error, message in (
        (float("inf"), ValueError, "JSON compliant"),
        ({"a": object()}, TypeError, "not JSON serializable"),
        ({1: "x", "a": "y"}, TypeError, "not supported"),
        (cycle, ValueError, "Circular reference"),
        (loop, ValueError, "Circular reference"),
        (deep, RecursionError, "recursion"),
    ):
        with pytest.raises(error, match=message):
            json.dumps(bad, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        with pytest.raises(error, match=message):
            canonical(bad)
    # nothing of a refused value stays behind: the same containers encode afterwards
    shared = {"k": [1, 2]}
    assert canonical([shared, shared]) == b'[{"k":[1,2]},{"k":[1,2]}]'


@given(
    data=st.dictionaries(st.text(max_size=8), json_values, max_size=5),
    at=st.text(),
    kind=st.text(),
    cid=st.none() | st.text(),
    server=st.none() | st.text(),
    call_id=st.none() | st.text(),
    seq=st.integers(1, 2**62),
    epoch=st.integers(0, 2**40),
)
@settings(max_examples=200, deadline=None)
def test_row_bytes_equals_canonical_of_the_row(
    data: dict[str, Any],
    at: str,
    kind: str,
    cid: str | None,
    server: str | None,
    call_id: str | None,
    seq: int,
    epoch: int,
) -> None:
    """The spliced fast path an auditor does not need: it must equal the plain definition."""
    row = {
        "seq": seq,
        "at": at,
        "kind": kind,
        "checkpoint_id": cid,
        "server": server,
        "call_id": call_id,
        "epoch": epoch,
        "data": data,
        "prev_hash": GENESIS_HASH,
    }
    text = canonical(data).decode()
    fast = row_bytes(
        seq=seq,
        at=at,
        kind=kind,
        checkpoint_id=cid,
        server=server,
        call_id=call_id,
        epoch=epoch,
        data_text=text,
        prev_hash=GENESIS_HASH,
    )
    assert fast == canonical(row)
    # the append path's hash of the same row, with a prev hash that is not genesis
    prev = hashlib.sha256(fast).hexdigest()
    row["prev_hash"] = prev
    expected = hashlib.sha256(prev.encode("ascii") + canonical(row)).hexdigest()
    assert next_hash((seq, at, kind, cid, server, call_id, epoch, text, prev)) == expected


def test_chain_hash_is_sha256_of_prev_hash_then_row() -> None:
    row = b'{"x":1}'
    assert chain_hash(GENESIS_HASH, row) == hashlib.sha256(GENESIS_HASH.encode("ascii") + row).hexdigest()


def test_redaction_of_authorization_and_secrets_everywhere() -> None:
    redactor = Redactor(["tok-123", "tok-123-long"])
    value = {
        "headers": {"Authorization": "Bearer whatever", "AUTHORIZATION": 5, "x": "a tok-123-long b"},
        "tok-123": ["tok-123", {"k": "pre-tok-123"}],
        "n": 1,
    }
    assert redactor.apply(value) == {
        "headers": {"Authorization": REDACTED, "AUTHORIZATION": REDACTED, "x": f"a {REDACTED} b"},
        REDACTED: [REDACTED, {"k": f"pre-{REDACTED}"}],
        "n": 1,
    }
    assert value["tok-123"] == ["tok-123", {"k": "pre-tok-123"}], "the input is not mutated"


def test_an_authorization_key_in_any_case_is_found_without_lowering_a_text_with_no_z() -> None:
    """The fast path's test for an ``authorization`` key skips the lowered copy of a text with no
    ``z`` or ``Z``: sound only because no other code point lowers to one."""
    assert [c for c in range(sys.maxunicode + 1) if "z" in chr(c).lower() and chr(c) not in "zZ"] == []
    redactor = Redactor([])
    for key in ("authorization", "AUTHORIZATION", "AuThOrIzAtIoN", "authoriZation"):
        value = {"headers": {key: "Bearer x"}, "long": "y" * 50_000}
        stored, text = redactor.encode(value, plain=True)
        assert stored["headers"][key] == REDACTED, key
        assert "Bearer" not in text
    plain = {"size": "no z in the key that matters", "Zone": 1, "authorisation": "kept"}
    assert redactor.encode(plain, plain=True) == (plain, canonical(plain).decode())


@given(
    value=st.dictionaries(st.text(max_size=6), json_values, max_size=5),
    secret=st.text(min_size=3, max_size=8),
)
@settings(max_examples=200, deadline=None)
def test_fast_path_agrees_with_the_full_walk(value: dict[str, Any], secret: str) -> None:
    redactor = Redactor([secret])
    stored, text = redactor.encode(value)
    assert stored == redactor.apply(value)
    assert text == canonical(redactor.apply(value)).decode()


@given(
    small=st.dictionaries(st.text(max_size=6), json_values, max_size=3),
    filler=st.text(min_size=1, max_size=12),
    planted=st.sampled_from(["", "tok-9", "Authorization", "http://u:pw@h/", 'q"tok']),
    length=st.sampled_from([BODY_CAP_BYTES // 4 - 40, BODY_CAP_BYTES - 60, BODY_CAP_BYTES + 1]),
    nested=st.booleans(),
    secrets=st.sampled_from([["tok-9"], ['q"tok'], []]),
)
@settings(max_examples=120, deadline=None)
def test_fast_path_agrees_with_the_full_walk_over_the_cap(
    small: dict[str, Any], filler: str, planted: str, length: int, nested: bool, secrets: list[str]
) -> None:
    """Payloads near and over the body cap — a big body beside small data, with a secret, an
    authorization key or a URL password planted in it or not — are stored exactly as the full
    walk (redaction, then capping) stores them, whether or not anything was capped."""
    redactor = Redactor(secrets)
    blob = (filler * (length // len(filler) + 1))[:length]
    body: Any = {"keys": [blob[i : i + 500] for i in range(0, len(blob), 500)], planted or "k": planted}
    value = {**small, "body": {"body": body} if nested else body, "status": 200}
    stored, text = redactor.encode(value)
    assert stored == redactor.apply(value)
    assert text == canonical(redactor.apply(value)).decode()
    if stored is value:  # stored as it is only when neither rule changes anything
        assert redactor.apply(value) == value


@given(
    columns=st.tuples(*[st.none() | st.text(max_size=12)] * 3),
    secrets=st.lists(st.text(min_size=1, max_size=4), max_size=3),
)
@settings(max_examples=300, deadline=None)
def test_the_text_columns_are_scrubbed_like_any_text(
    columns: tuple[str | None, str | None, str | None], secrets: list[str]
) -> None:
    """``Redactor.columns`` (checkpoint id, server, call id at once) is ``Redactor.text`` of each."""
    redactor = Redactor(secrets)
    assert redactor.columns(*columns) == tuple(None if c is None else redactor.text(c) for c in columns)


def test_the_text_columns_lose_every_secret() -> None:
    redactor = Redactor(["tok-1", "tok-12"])
    assert redactor.columns("c-tok-12", None, "tok-1/x") == (f"c-{REDACTED}", None, f"{REDACTED}/x")
    assert redactor.columns("c1", "agent", None) == ("c1", "agent", None)


def test_body_over_the_cap_becomes_digest_and_prefix() -> None:
    small = {"body": {"blob": "x" * 1000}}
    assert cap_bodies(small) is small, "nothing capped: the value itself"
    big_body = {"blob": "é" * BODY_CAP_BYTES}
    capped = cap_bodies({"outer": [{"body": big_body}], "body": None})
    digest = capped["outer"][0]["body"]
    encoded = canonical(big_body)
    assert digest == {
        "sha256": hashlib.sha256(encoded).hexdigest(),
        "bytes": len(encoded),
        "prefix": encoded.decode()[:1024],
    }
    assert capped["body"] is None
    assert big_body == {"blob": "é" * BODY_CAP_BYTES}, "the input is not mutated"
    # exactly at the cap stays; one byte over is capped
    at_cap = "a" * (BODY_CAP_BYTES - 2)  # plus two quotes
    assert cap_bodies({"body": at_cap}) == {"body": at_cap}
    assert "sha256" in cap_bodies({"body": at_cap + "a"})["body"]


def _strip(event: Event) -> Event:
    """``event`` with only the payload replay keeps of it (``payload_read_by_fold``)."""
    kept = payload_read_by_fold(event.kind, canonical(event.data).decode())
    return Event(
        event.seq,
        event.at,
        event.kind,
        event.checkpoint_id,
        event.server,
        event.call_id,
        event.epoch,
        {} if kept is None else kept,
        event.prev_hash,
        event.hash,
    )


def _fold_all(events: list[Event]) -> dict[str, AttemptRow]:
    return fold_events(events)


@pytest.mark.parametrize("seed", range(5))
def test_fold_reads_payloads_only_of_the_declared_kinds(seed: int) -> None:
    """Replay decodes only the declared kinds' payloads and keeps only their declared keys; that
    must not change the result."""
    items = random_items(random.Random(seed), 2000)
    events = [
        Event(
            i + 1,
            f"2025-01-01T00:00:{i % 60:02d}.000000Z",
            it.kind,
            it.checkpoint_id,
            it.server,
            it.call_id,
            1,
            json.loads(json.dumps(it.data)),
            "",
            "",
        )
        for i, it in enumerate(items)
    ]
    full = _fold_all(events)
    assert full == _fold_all([_strip(e) for e in events])
    states = {row.state for row in full.values()}
    assert {"aborted", "completed"} <= states, "the generator reaches terminal states"


#: Every key a payload model has (independent of what fold is declared to read), and two others.
_PAYLOAD_KEYS = sorted({name for model in PAYLOADS.values() for name in model.model_fields} | {"x", ""})
_ROWS = [
    None,
    AttemptRow("c1", "save", "prepare", None, "t0", None, 5.0, ("a",), 1, 3, 0, None, 7),
    AttemptRow("c1", "restore", "completed", "restored", "t0", "t9", None, (), 2, 0, 1, 4, 9),
]


_VALUES = (
    json_values
    | st.lists(st.text(max_size=3) | st.integers(), max_size=3)
    | st.dictionaries(st.sampled_from(["c1", "c2", "c3"]), st.sampled_from(["abandoned", "aborted", 1, None]))
)


@given(data=st.fixed_dictionaries({}, optional=dict.fromkeys(_PAYLOAD_KEYS, _VALUES)))
@example(data=dict.fromkeys(_PAYLOAD_KEYS, 1))
@example(
    data={
        **dict.fromkeys(_PAYLOAD_KEYS, "v"),
        "kind": "save",
        "deadline_ts": 12.5,
        "participants": ["a", "b"],
        "phase": "commit",
        "outcome": "published",
        "outcomes": {"c1": "abandoned", "c2": "aborted"},
    }
)
@settings(max_examples=200, deadline=None)
def test_fold_of_the_kept_payload_is_fold_of_the_whole(data: dict[str, Any]) -> None:
    """What replay keeps of a payload (``payload_read_by_fold``) folds as the whole payload does:
    for every kind, on no row, a live row and a terminal one."""
    # as stored: replay decodes the canonical text, so the whole payload is that text decoded
    decoded = json.loads(canonical(data))
    for kind in sorted(KINDS):
        for cid in (None, "c1", "c2"):
            whole = Event(8, "t8", kind, cid, "s", None, 3, decoded, "", "")
            kept = _strip(whole)
            if kind in KINDS_READ_BY_FOLD:
                assert set(kept.data) <= set(KEYS_READ_BY_FOLD[kind])
            else:
                assert kept.data == {}
            assert touched(kept) == touched(whole)
            for row in _ROWS:
                for touched_id in {*touched(whole), "c1"}:
                    assert fold(row, kept, touched_id) == fold(row, whole, touched_id)


@pytest.mark.parametrize("text", ["[1]", "not json", "", "5", "null", '"x"', 5, None, b'{"phase": "p"}'])
def test_a_stored_payload_that_is_no_object_is_read_as_empty(text: Any) -> None:
    """Replay reads what ``json.loads`` makes of the stored text; anything but an object is ``{}``."""
    for kind in KINDS_READ_BY_FOLD:
        expected = {"phase": "p"} if isinstance(text, bytes) and kind == "phase.started" else {}
        assert payload_read_by_fold(kind, text) == expected
    assert payload_read_by_fold("phase.completed", text) is None


def test_rows_built_positionally_equal_the_dataclass() -> None:
    """``fold`` builds rows without ``AttemptRow.__init__``; they must be the same rows."""
    assert tuple(f.name for f in dataclasses.fields(AttemptRow)) == COLUMNS
    values = ("c1", "save", "prepare", None, "t1", None, 2.5, ("a", "b"), 3, 4, 5, None, 6)
    built = _row(*values)
    assert type(built) is AttemptRow
    assert built == AttemptRow(*values)
    assert hash(built) == hash(AttemptRow(*values))
    assert repr(built) == repr(AttemptRow(*values))
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.calls = 9  # type: ignore[misc]
    assert replace(built, calls=9, outcome="aborted") == dataclasses.replace(
        built, calls=9, outcome="aborted"
    )
    assert replace(built) == built
    with pytest.raises(TypeError, match="no column 'nope'"):
        replace(built, nope=1)


def test_events_built_positionally_equal_the_dataclass() -> None:
    """The ledger builds appended events without ``Event.__init__``; they must be the same events."""
    values = (7, "t7", "call.sent", "c1", "agent", "k1", 2, {"phase": "prepare"}, "a" * 64, "b" * 64)
    built = new_event(*values)
    assert type(built) is Event
    assert built == Event(*values)
    assert repr(built) == repr(Event(*values))
    assert built.columns() == Event(*values).columns()
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.seq = 9  # type: ignore[misc]


def test_a_row_is_stored_column_by_column_with_its_participants_as_json() -> None:
    row = AttemptRow("c1", "save", "prepare", None, "t1", None, 2.5, ("a", "b"), 3, 4, 5, None, 6)
    stored = ("c1", "save", "prepare", None, "t1", None, 2.5, '["a","b"]', 3, 4, 5, None, 6)
    assert stored_values(row) == stored
    assert to_columns(row) == dict(zip(COLUMNS, stored, strict=True))
    empty = ("c2", "restore", "aborted", "aborted", "t1", "t2", None, (), 1, 0, 2, 3, 9)
    assert stored_values(AttemptRow(*empty)) == (*empty[:7], "[]", *empty[8:])


def test_fold_lifecycle() -> None:
    def ev(seq: int, kind: str, data: dict[str, Any], cid: str | None = "c1", epoch: int = 1) -> Event:
        return Event(seq, f"t{seq}", kind, cid, None, None, epoch, data, "", "")

    row = fold(None, ev(1, "attempt.started", {"kind": "save", "deadline_ts": 5, "participants": ["a", "b"]}))
    assert row is not None
    assert (row.state, row.kind, row.deadline_ts, row.participants, row.started_at) == (
        "started",
        "save",
        5.0,
        ("a", "b"),
        "t1",
    )
    row = fold(row, ev(2, "phase.started", {"phase": "prepare"}))
    assert row is not None
    assert row.state == "prepare"
    assert touched(ev(3, "call.sent", {})) == ()  # counted by the next event that touches the row:
    assert fold(row, ev(3, "call.sent", {})) is row
    row = fold(row, ev(4, "call.failed", {}), sent=1)
    assert row is not None
    assert (row.calls, row.failures, row.last_seq) == (1, 1, 4)
    assert touched(ev(5, "call.replied", {})) == ()
    row = fold(row, ev(6, "attempt.completed", {"outcome": "published"}))
    assert row is not None
    assert (row.state, row.outcome, row.ended_at) == ("completed", "published", "t6")
    row = fold(row, ev(7, "phase.started", {"phase": "late"}))
    assert row is not None
    assert row.state == "completed", "terminal rows keep their state"
    row = fold(row, ev(8, "recovery.completed", {"outcomes": {"c1": "abandoned"}}, cid=None, epoch=2))
    assert row is not None
    assert (row.outcome, row.recovered_by) == ("published", 2)
    assert fold(None, ev(9, "call.sent", {}, cid="nobody")) is None
    # a stream: calls before the start are never counted; those after the last touch wait for one
    stream = [
        ev(20, "call.sent", {}, cid="c3"),
        ev(21, "attempt.started", {"kind": "save", "participants": []}, cid="c3"),
        ev(22, "call.sent", {}, cid="c3"),
        ev(23, "call.sent", {}, cid="c3"),
        ev(24, "call.replied", {}, cid="c3"),
        ev(25, "phase.started", {"phase": "commit"}, cid="c3"),
        ev(26, "call.sent", {}, cid="c3"),
    ]
    folded = fold_events(stream)["c3"]
    assert (folded.calls, folded.last_seq, folded.state) == (2, 25, "commit")
    assert fold_events(stream[:4])["c3"].calls == 0

    restore = fold(
        None, ev(10, "attempt.started", {"kind": "restore", "deadline_ts": 1, "participants": []}, cid="r1")
    )
    done = fold(restore, ev(11, "recovery.completed", {"outcomes": {"r1": "abandoned"}}, cid=None, epoch=3))
    assert done is not None
    assert (done.state, done.outcome, done.recovered_by) == ("abandoned", "abandoned", 3)


def _chain(rows: list[tuple[str, str | None, dict[str, Any]]]) -> list[Any]:
    out: list[Any] = []
    prev = GENESIS_HASH
    for seq, (kind, cid, data) in enumerate(rows, start=1):
        text = canonical(data).decode()
        at = f"2025-01-01T00:00:00.{seq:06d}Z"
        digest = chain_hash(
            prev,
            row_bytes(seq=seq, at=at, kind=kind, checkpoint_id=cid, server='sé"\\\n', call_id=None, epoch=1,
                      data_text=text, prev_hash=prev),
        )  # fmt: skip
        out.append((seq, at, kind, cid, 'sé"\\\n', None, 1, text, prev, digest))
        prev = digest
    return out


def test_replayer_agrees_with_the_chain_definition_and_names_the_bad_seq() -> None:
    from quiesce.ledger.replay import Replayer

    rows = _chain([("call.sent", f"c\u2028{i}\x01", {"k": f"ü{i}\t", "n": i}) for i in range(50)])
    good = Replayer()
    good.feed(rows[:20])
    good.feed(rows[20:])
    assert good.report.chain_ok
    assert (good.report.events, good.report.head_seq, good.report.head_hash) == (50, 50, rows[-1][9])

    edited = list(rows)
    edited[30] = (*rows[30][:7], rows[30][7].replace("ü", "u"), *rows[30][8:])
    bad = Replayer()
    bad.feed(edited)
    assert (bad.report.first_bad_seq, bad.report.chain_ok) == (31, False)

    gap = Replayer()
    gap.feed(rows[:10] + rows[12:])
    assert gap.report.first_bad_seq == 11
    assert gap.report.problem == "seq 11..12 missing (rows deleted); next seq is 13"


def test_head_revision_constant_matches_alembic() -> None:
    """`HEAD_REVISION` lets an open skip alembic; it must name the real head of migrations/."""
    from quiesce.ledger.migrate import head_revision
    from quiesce.ledger.schema import HEAD_REVISION

    assert head_revision() == HEAD_REVISION
