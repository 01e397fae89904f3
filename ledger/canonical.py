"""Canonical encoding and the hash chain. An external auditor can reimplement this file alone.

Canonical encoding of a JSON value ``v``::

    json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")

(object keys sorted by code point, no whitespace, non-ASCII characters kept as UTF-8, NaN and
infinities refused).

Each row of ``events`` carries ``prev_hash`` and ``hash``. With ``row_without_hash`` the JSON object
of every other column of the row::

    {"at": str, "call_id": str|null, "checkpoint_id": str|null, "data": <the payload object>,
     "epoch": int, "kind": str, "prev_hash": str, "seq": int, "server": str|null}

the chain is::

    hash = sha256(prev_hash.encode("ascii") + canonical(row_without_hash)).hexdigest()

where ``prev_hash`` is the ``hash`` of the row with seq - 1, and ``"0" * 64`` for seq 1 (genesis).
Hashes are lowercase hex. ``seq`` starts at 1 and has no gaps.

The ``data`` column stores ``canonical(payload)`` decoded as UTF-8 text. Because it is already
canonical, ``canonical(row_without_hash)`` can be built by splicing the stored text in place of
the payload (``row_bytes`` does that); a stored ``data`` text that is not canonical therefore fails
verification, which is intended: the stored bytes are what the chain protects.
"""

from __future__ import annotations

import hashlib
import json
from json.encoder import c_make_encoder, encode_basestring  # type: ignore[attr-defined]
from typing import Any, Final

GENESIS_HASH: Final = "0" * 64

_encoder = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, check_circular=True
)
_encode_str: Any = encode_basestring
#: ``json``'s C encoder, when this Python has it, built once without the markers dict that finds
#: cycles: ``_encoder.encode`` builds one per call anyway, and a cycle (or a value nested deeper
#: than the stack) only ever ends in ``RecursionError`` here, after which the checked path below
#: gives the error ``json.dumps`` gives. Immutable once built, so threads may share it.
_fast_encoder: Any = (
    None
    if c_make_encoder is None
    else c_make_encoder(None, _encoder.default, encode_basestring, None, ":", ",", True, False, False)
)


def _dumps(value: Any) -> str:
    if _fast_encoder is None:
        return _encoder.encode(value)
    try:
        return "".join(_fast_encoder(value, 0))
    except RecursionError:
        # a cycle (refused with json's ValueError) or nesting too deep (RecursionError, as json.dumps)
        return _encoder.encode(value)


def canonical_text(value: Any) -> str:
    """The canonical encoding of ``value`` as text; ``ValueError``/``TypeError`` if not plain JSON."""
    return _dumps(value)


def canonical(value: Any) -> bytes:
    """The canonical encoding of ``value`` as bytes (UTF-8)."""
    return _dumps(value).encode("utf-8")


def _opt(value: str | None) -> str:
    return "null" if value is None else _encode_str(value)


def row_bytes(
    *,
    seq: int,
    at: str,
    kind: str,
    checkpoint_id: str | None,
    server: str | None,
    call_id: str | None,
    epoch: int,
    data_text: str,
    prev_hash: str,
) -> bytes:
    """``canonical(row_without_hash)`` given the stored (canonical) ``data`` text.

    Equal to ``canonical({... "data": json.loads(data_text) ...})`` whenever ``data_text`` is canonical.
    """
    return (
        f'{{"at":{_encode_str(at)},"call_id":{_opt(call_id)},"checkpoint_id":{_opt(checkpoint_id)},'
        f'"data":{data_text},"epoch":{int(epoch)},"kind":{_encode_str(kind)},'
        f'"prev_hash":{_encode_str(prev_hash)},"seq":{int(seq)},"server":{_opt(server)}}}'
    ).encode()


def chain_hash(prev_hash: str, row: bytes) -> str:
    """``sha256(prev_hash ascii bytes + row).hexdigest()``."""
    return hashlib.sha256(prev_hash.encode("ascii") + row).hexdigest()
