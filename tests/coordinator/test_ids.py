"""Checkpoint ids (`quiesce.coordinator.ids`): Gym's rule, sortable within one ledger, unique across ledgers,
old ids still read — and a real ledger's id: from its first event, the same at every open."""

from __future__ import annotations

import re
import uuid

import pytest

from quiesce.coordinator.attempt import ledger_id, next_checkpoint_id
from quiesce.coordinator.ids import checkpoint_id, epoch_of, ledger_id_of
from quiesce.coordinator.protocol import CHECKPOINT_ID_PATTERN
from quiesce.ledger import Ledger

GYM = re.compile(CHECKPOINT_ID_PATTERN)
HASH = "7c3e1f0a2b" + "0" * 54
WRITER = "5c01d2" + "f" * 58


def test_ids_keep_gyms_rule_and_sort_as_their_attempts_started() -> None:
    lid = ledger_id_of(HASH)
    assert lid == "7c3e1f0a2b"
    # epochs 9 → 10 → 123 and seqs of every width: string order is start order
    made = [
        checkpoint_id(lid, epoch, seq, WRITER)
        for epoch, seq in [(1, 13), (9, 999), (10, 1000), (10, 99_999), (123, 100_000), (124, 9_999_999_999)]
    ]
    assert sorted(made) == made
    for cid in made:
        assert GYM.match(cid), cid
        assert len(cid) <= 128
    assert [epoch_of(cid) for cid in made] == [1, 9, 10, 10, 123, 124]


def test_new_ids_sort_after_the_legacy_ids_of_the_same_ledger() -> None:
    legacy = [checkpoint_id(None, 1, 13), checkpoint_id(None, 9, 900)]
    assert legacy == ["e1-000013", "e9-000900"]
    assert [epoch_of(cid) for cid in legacy] == [1, 9]
    new = checkpoint_id(ledger_id_of("0" * 64), 10, 901, "0" * 64)  # the smallest ledger id there is
    assert sorted([*legacy, new])[-1] == new


def test_ids_of_two_ledgers_differ_where_their_seqs_meet() -> None:
    a = checkpoint_id(ledger_id_of("a" * 64), 1, 13, WRITER)
    b = checkpoint_id(ledger_id_of("b" * 64), 1, 13, WRITER)
    assert a != b


def test_ids_of_two_writers_of_copies_of_one_ledger_differ_at_the_same_epoch_and_seq() -> None:
    lid = ledger_id_of(HASH)
    a = checkpoint_id(lid, 3, 120, "1" * 64)
    b = checkpoint_id(lid, 3, 120, "2" * 64)
    assert a != b
    assert a == "q7c3e1f0a2b-0000000120-e3-w111111"
    assert epoch_of(a) == epoch_of(b) == 3


def test_an_id_of_a_real_ledger_needs_its_writers_hash() -> None:
    with pytest.raises(ValueError, match=r"coordinator\.started"):
        checkpoint_id(ledger_id_of(HASH), 1, 2, "")


def test_ids_written_before_the_writer_part_still_read() -> None:
    assert epoch_of("q7c3e1f0a2b-0000000042-e7") == 7


@pytest.mark.parametrize("text", ["", "e1-000013", "xyz", "A" * 64, "0" * 63])
def test_a_ledger_id_comes_only_from_a_hash(text: str) -> None:
    assert ledger_id_of(text) is None


@pytest.mark.parametrize(
    "foreign", ["e1", "ckpt-42", "qzz-0000000001-e1", "q12-abc-e1", "q12-0000000001-e1-wXYZ", "q12-1-e1-w"]
)
def test_ids_quiesce_did_not_make_have_no_epoch(foreign: str) -> None:
    assert epoch_of(foreign) is None


@pytest.mark.anyio
async def test_a_ledgers_id_is_its_first_events_hash_and_never_changes(
    ledger_url: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    async with Ledger.open(ledger_url) as ledger:
        first = await ledger.start_epoch(
            {"coordinator": {"host": "h", "pid": 1, "uuid": "u"}, "version": "t"}
        )
        made = await next_checkpoint_id(ledger)
        assert made == checkpoint_id(first.hash[:10], ledger.epoch, first.seq + 1, first.hash)
    async with Ledger.open(ledger_url) as ledger:
        await ledger.start_epoch({"coordinator": {"host": "h", "pid": 2, "uuid": "v"}, "version": "t"})
        assert await ledger_id(ledger) == first.hash[:10]
        later = await next_checkpoint_id(ledger)
    assert later > made
    # another fresh ledger of the same backend: another id
    if ledger_url.startswith("sqlite"):
        other = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('other') / 'ledger.db'}"
    else:
        other = request.getfixturevalue("postgres").create_database(f"t_{uuid.uuid4().hex[:20]}")
    async with Ledger.open(other) as ledger:
        await ledger.start_epoch({"coordinator": {"host": "h", "pid": 1, "uuid": "u"}, "version": "t"})
        assert await ledger_id(ledger) not in (None, first.hash[:10])
