"""Canonical encoding and the hash chain. An external auditor can reimplement this file alone.

Canonical encoding of a JSON value ``v``::

    json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")

(object keys sorted by code point, no whitespace, non-ASCII characters kept as UTF-8, NaN and
infinities refused). That line is the definition. This module writes the same bytes with orjson
(several times faster) for a value whose orjson bytes are known to be those (``_orjson_same``) and
with ``json`` for any other; ``tests/ledger/test_pure.py`` holds the two to the definition.

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
from types import ModuleType
from typing import Any, Final, TypeAlias

_orjson_module: ModuleType | None
try:
    import orjson as _orjson_module
except ImportError:  # a process started without site-packages (the replay workers: ``python -S``)
    _orjson_module = None

GENESIS_HASH: Final = "0" * 64

_encoder = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, check_circular=True
)
_encode_str: Any = encode_basestring
_sha256 = hashlib.sha256
#: ``json``'s C encoder, when this Python has it, built once without the markers dict that finds
#: cycles: ``_encoder.encode`` builds one per call anyway, and a cycle (or a value nested deeper
#: than the stack) only ever ends in ``RecursionError`` here, after which the checked path below
#: gives the error ``json.dumps`` gives. Immutable once built, so threads may share it.
_fast_encoder: Any = (
    None
    if c_make_encoder is None
    else c_make_encoder(None, _encoder.default, encode_basestring, None, ":", ",", True, False, False)
)


#: The float magnitudes that ``repr`` (hence ``json``) writes without an exponent: 1e-4 <= |x| <
#: 1e16. orjson writes the same shortest round-trip digits, and in this range the same way; outside
#: it the two differ (``1e+16`` against ``1e16``, ``1e-05`` against ``0.00001``).
FIXED_FLOAT_LO: Final = 1e-4
FIXED_FLOAT_HI: Final = 1e16
#: orjson's own limit is 254 levels; deeper values take json's path (which gives its errors too).
_ORJSON_MAX_DEPTH: Final = 200
_ORJSON_DUMPS: Final[Any] = None if _orjson_module is None else _orjson_module.dumps
_ORJSON_ERROR: Final[type[Exception]] = (
    TypeError if _orjson_module is None else _orjson_module.JSONEncodeError
)
_SORT_KEYS: Final = 0 if _orjson_module is None else _orjson_module.OPT_SORT_KEYS


def _orjson_same(value: Any, depth: int = 0) -> bool:
    """Whether orjson's sorted compact output of ``value`` is byte for byte ``json``'s canonical one:
    exact JSON types only (dict with str keys, list, str, int, bool, None: no subclass, tuple,
    enum, dataclass, date or UUID, which orjson writes and json refuses or writes otherwise), and
    every float 0 or in the range both write the same way. A str with a lone surrogate or an int
    past 64 bits is left to orjson, which refuses it (then json decides)."""
    kind = type(value)
    if kind is dict:
        if depth >= _ORJSON_MAX_DEPTH:
            return False
        for key, item in value.items():
            if type(key) is not str:
                return False
            inner = type(item)
            if inner is str or inner is int or inner is bool or item is None:
                continue
            if inner is float:  # (checked here: most floats are an object's values; NaN fails)
                if not (item == 0.0 or FIXED_FLOAT_LO <= abs(item) < FIXED_FLOAT_HI):
                    return False
            elif not _orjson_same(item, depth + 1):
                return False
        return True
    if kind is list:
        if depth >= _ORJSON_MAX_DEPTH:
            return False
        for item in value:
            inner = type(item)
            if inner is str or inner is int or inner is bool or item is None:
                continue
            if not _orjson_same(item, depth + 1):
                return False
        return True
    if kind is str or kind is int or kind is bool or value is None:
        return True
    if kind is float:
        number: float = value
        return number == 0.0 or FIXED_FLOAT_LO <= abs(number) < FIXED_FLOAT_HI
    return False


def _orjson(value: Any) -> bytes | None:
    """orjson's encoding of ``value`` when it is the canonical one (``_orjson_same``), else None
    (and always None without orjson)."""
    if _ORJSON_DUMPS is None or not _orjson_same(value):
        return None
    try:
        return _ORJSON_DUMPS(value, option=_SORT_KEYS)  # type: ignore[no-any-return]
    except _ORJSON_ERROR:  # a lone surrogate, an int past 64 bits: json's path decides
        return None


def _dumps(value: Any) -> str:
    fast = _orjson(value)
    return fast.decode() if fast is not None else _json_text(value)


def _json_text(value: Any) -> str:
    """The definition's own encoder: ``json``'s, for every value orjson is not used for."""
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


def canonical_text_of_plain(value: Any) -> str:
    """``canonical_text(value)`` for a value known to be plain JSON of exact types whose every
    float is 0 or within ``FIXED_FLOAT_LO`` <= |x| < ``FIXED_FLOAT_HI`` (what the payloads' fast
    path accepts: ``quiesce.ledger.payloads.validate_plain``): orjson writes it without the walk
    that ``_orjson_same`` makes. Any other value may come out otherwise than ``canonical_text``."""
    if _ORJSON_DUMPS is not None:
        try:
            return _ORJSON_DUMPS(value, option=_SORT_KEYS).decode()  # type: ignore[no-any-return]
        except _ORJSON_ERROR:  # a lone surrogate, an int past 64 bits, too deep: json's path decides
            pass
    return _json_text(value)


def canonical(value: Any) -> bytes:
    """The canonical encoding of ``value`` as bytes (UTF-8)."""
    fast = _orjson(value)
    return fast if fast is not None else _json_text(value).encode("utf-8")


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


#: A row of ``events`` without its hash, in table order: seq, at, kind, checkpoint_id, server,
#: call_id, epoch, data (the stored text), prev_hash.
UnhashedRow: TypeAlias = tuple[int, str, str, str | None, str | None, str | None, int, str, str]


def next_hash(row: UnhashedRow) -> str:
    """``chain_hash(prev_hash, row_bytes(...))`` of a row the ledger chains: its ``prev_hash``
    lowercase hex (a hash of the chain, which needs no escaping) and its seq and epoch plain ints,
    as the append path has them; one string built and encoded once, not two joined."""
    seq, at, kind, checkpoint_id, server, call_id, epoch, data_text, prev_hash = row
    return _sha256(
        f'{prev_hash}{{"at":{_encode_str(at)},'
        f'"call_id":{"null" if call_id is None else _encode_str(call_id)},'
        f'"checkpoint_id":{"null" if checkpoint_id is None else _encode_str(checkpoint_id)},'
        f'"data":{data_text},"epoch":{epoch:d},"kind":{_encode_str(kind)},"prev_hash":"{prev_hash}",'
        f'"seq":{seq:d},"server":{"null" if server is None else _encode_str(server)}}}'.encode()
    ).hexdigest()
