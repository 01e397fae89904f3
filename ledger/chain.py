"""Checking stored ``events`` rows against the hash chain of ``quiesce.ledger.canonical``, a page at a time.

``check_rows(rows, after)`` returns the first problem of ``rows`` (consecutive stored rows in seq
order) as ``(seq, what is wrong)``, or None. Each row is checked, in this order, for:

1. its seq: the previous row's seq + 1 (else "missing" rows, reported at the first missing seq,
   or "out of order", reported at this seq);
2. its ``prev_hash``: the previous row's stored ``hash``;
3. its ``hash``: ``chain_hash(prev_hash, row_bytes(row))``.

``after`` is ``(seq, hash)`` of the row before ``rows[0]`` — ``(0, GENESIS_HASH)`` before the first
row of a chain — or None, which skips checks 1 and 2 for ``rows[0]``: its caller links it with
``link`` once the row before is known (a parallel replay checks ranges of seqs independently).

The verdict is always the one of the row-by-row definition (``_check_exact``, built on
``row_bytes`` and ``chain_hash``). The fast path only accepts: it builds every row's bytes by
plain splicing, which equals ``row_bytes`` exactly when the text columns are ``str`` holding no
character the canonical encoding escapes (``"``, ``\\``, U+0000 to U+001F), ``epoch`` and ``seq``
are ``int``, and each ``prev_hash`` equals the previous row's verified hash (hex digits; for an
unlinked ``rows[0]`` that is for ``link`` to establish, and ``link`` comes first). So even a hash
forged over such spliced bytes cannot pass it. A page it does not accept, for whatever reason,
is checked by the definition.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import partial
from operator import is_not
from typing import Any, TypeAlias

from quiesce.ledger.canonical import GENESIS_HASH, chain_hash, row_bytes

#: ``(seq, what is wrong)``: the first bad seq of a chain and the reason.
Problem: TypeAlias = tuple[int, str]

EDITED = "hash mismatch: the stored row differs from what was hashed (row edited)"
UNLINKED = "prev_hash does not match the hash of the previous row"

_not_none = partial(is_not, None)
_sha256 = hashlib.sha256
_Q = '"'
#: The UTF-8 encodings of the characters ``json.encoder.encode_basestring`` (the canonical
#: encoding of text) escapes: ``"``, ``\\`` and U+0000 to U+001F, one byte each.
_ESCAPED_BYTES = b'"\\' + bytes(range(0x20))
_INT = {int}
_HEX_LENGTH = {64}


def link(after: tuple[int, str], seq: int, prev_hash: str) -> Problem | None:
    """Checks 1 and 2 of a row with ``seq`` and ``prev_hash`` following ``after`` = (seq, hash)."""
    last_seq, last_hash = after
    if seq != last_seq + 1:
        if seq > last_seq + 1:
            missing = f"{last_seq + 1}" if seq == last_seq + 2 else f"{last_seq + 1}..{seq - 1}"
            return last_seq + 1, f"seq {missing} missing (rows deleted); next seq is {seq}"
        return seq, f"seq {seq} out of order after seq {last_seq}"
    if prev_hash != last_hash:
        return seq, UNLINKED
    return None


def check_rows(rows: Sequence[Sequence[Any]], after: tuple[int, str] | None) -> Problem | None:
    """The first problem of ``rows`` (see the module docstring), or None."""
    if not rows or _fast(rows, after):
        return None
    return _check_exact(rows, after)


def _check_exact(rows: Sequence[Sequence[Any]], after: tuple[int, str] | None) -> Problem | None:
    """The definition: each row linked to the previous one and its hash recomputed."""
    for row in rows:
        seq, at, kind, cid, server, call_id, epoch, data_text, prev_hash, digest = row
        if after is not None:
            problem = link(after, seq, prev_hash)
            if problem is not None:
                return problem
        try:
            expected = chain_hash(
                prev_hash,
                row_bytes(seq=seq, at=at, kind=kind, checkpoint_id=cid, server=server, call_id=call_id,
                          epoch=epoch, data_text=data_text, prev_hash=prev_hash),
            )  # fmt: skip
        except (TypeError, ValueError) as error:  # a column of the wrong type (UnicodeError included)
            return seq, f"the stored row cannot be hashed ({type(error).__name__}: {error})"
        if expected != digest:
            return seq, EDITED
        after = (seq, digest)
    return None


def truncation(head_seq: int, recorded_last_seq: int | None) -> Problem | None:
    """The problem of a chain that ends at ``head_seq`` while the ``attempts`` projection (updated in
    the same transactions as the events) records ``recorded_last_seq``: rows removed from the end."""
    if recorded_last_seq is None or recorded_last_seq <= head_seq:
        return None
    return (
        head_seq + 1,
        f"seq {head_seq + 1}..{recorded_last_seq} missing: the attempts projection records seq"
        f" {recorded_last_seq}, the events end at seq {head_seq} (rows removed from the end, or the"
        " projection edited)",
    )


class ChainCheck:
    """The whole chain, fed page by page in seq order from seq 1: ``feed(rows)`` for each page,
    then ``finish(recorded_last_seq)``; ``problem`` is the first one found (None: the chain holds).

    Exactly the verdict of ``check_rows`` over all rows at once, plus ``truncation`` at the end."""

    def __init__(self) -> None:
        self.after: tuple[int, str] = (0, GENESIS_HASH)
        self.rows = 0
        self.problem: Problem | None = None

    def feed(self, rows: Sequence[Sequence[Any]]) -> None:
        if not rows:
            return
        if self.problem is None:
            self.problem = check_rows(rows, self.after)
        self.after = (rows[-1][0], rows[-1][9])
        self.rows += len(rows)

    def finish(self, recorded_last_seq: int | None) -> Problem | None:
        if self.problem is None:
            self.problem = truncation(int(self.after[0]), recorded_last_seq)
        return self.problem


def check_each(rows: Sequence[Sequence[Any]]) -> Problem | None:
    """The first row of ``rows`` whose hash does not recompute from its own content (rows of one
    attempt: not consecutive, so links to the rows between them are not checked)."""
    for row in rows:
        problem = check_rows([row], None)
        if problem is not None:
            return problem
    return None


class _Refused(Exception):
    """A value the fast path does not splice: the page goes to the definition."""


class _Quoted(dict[Any, str]):
    """A ``str`` with no character to escape -> itself in quotes, which is its canonical encoding;
    ``None`` -> ``null`` when ``nullable``. Any other value raises ``_Refused``. Kept between pages
    (kinds, checkpoint ids and servers recur), emptied past ``_QUOTED_MAX`` entries."""

    def __init__(self, *, nullable: bool) -> None:
        super().__init__()
        self._nullable = nullable
        self.clear()

    def clear(self) -> None:
        super().clear()
        if self._nullable:
            self[None] = "null"

    def __missing__(self, value: Any) -> str:
        if type(value) is not str or _escapes(value):
            raise _Refused
        if len(self) >= _QUOTED_MAX:
            self.clear()
        text = self[value] = f'"{value}"'
        return text


_QUOTED_MAX = 4096
_quoted_kind = _Quoted(nullable=False)
_quoted_opt = _Quoted(nullable=True)


def _escapes(text: str) -> bool:
    """Whether ``text`` holds a character the canonical encoding escapes.

    Their UTF-8 encodings are the single bytes ``_ESCAPED_BYTES``, and no other character's
    encoding holds any of these bytes, so deleting them shortens the encoding exactly when
    ``text`` holds one. ``UnicodeEncodeError`` (a ``ValueError``) for text without a UTF-8 encoding."""
    encoded = text.encode()
    return len(encoded.translate(None, _ESCAPED_BYTES)) != len(encoded)


def _fast(rows: Sequence[Sequence[Any]], after: tuple[int, str] | None) -> bool:
    """True only if every row of ``rows`` passes all three checks (see the module docstring)."""
    seqs, ats, _, _, _, call_ids, epochs, datas, prevs, hashes = zip(*rows, strict=True)
    first = seqs[0]
    if after is not None and (first != after[0] + 1 or prevs[0] != after[1]):
        return False
    if type(first) is not int or seqs != tuple(range(first, first + len(seqs))):
        return False
    if {*map(type, seqs), *map(type, epochs)} != _INT:  # ints only: no format spec needed below
        return False
    if prevs[1:] != hashes[:-1]:
        return False
    try:
        "".join(datas)  # TypeError unless every one is a str
        if _escapes("".join([*ats, *filter(_not_none, call_ids)])):  # the others: _Quoted
            return False
        kq, oq, q = _quoted_kind, _quoted_opt, _Q
        digests = [
            _sha256(
                f'{p}{{"at":"{at}","call_id":{"null" if ci is None else q + ci + q},'
                f'"checkpoint_id":{oq[c]},"data":{d},"epoch":{e},"kind":{kq[k]},'
                f'"prev_hash":"{p}","seq":{s},"server":{oq[sv]}}}'.encode()
            ).digest()
            for s, at, k, c, sv, ci, e, d, p, _ in rows
        ]
        # Every stored hash is 64 characters and together they are the digests in lowercase hex.
        return set(map(len, hashes)) == _HEX_LENGTH and b"".join(digests).hex() == "".join(hashes)
    except (TypeError, ValueError, _Refused):  # a column of the wrong type, or to escape
        return False
