"""Reply bodies as the coordinator parses them (`calls._parse_reply`): a number that overflows a
float is refused, whatever its form, and nothing else is; the cheap test that decides whether the
parsed reply is walked for infinities misses no overflowing number."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quiesce.coordinator.calls import _all_finite, _may_overflow, _parse_reply

OVERFLOWING = [
    b'{"t": 1e400}',
    b'{"t": 1E+400}',
    b'{"t": -1e309}',
    b'{"t": 1.5e0400}',
    b"[2e1000]",
    b'{"t": ' + b"9" * 309 + b".5}",
    b'{"t": ' + b"9" * 400 + b".0e0}",
    b'{"deep": [[{"x": 7e999}]]}',
]

KEPT = [
    b'{"t": 1e308}',
    b'{"t": 1.7976931348623157e+308}',
    b'{"t": 1e-400}',
    b'{"t": 12e0099}',
    b'{"big": ' + b"9" * 400 + b"}",  # an int: exact, never a float
    b'{"sha256": "3e1234e5678e999e400", "s": "' + b"1" * 500 + b'"}',
]


@pytest.mark.parametrize("raw", OVERFLOWING, ids=[r[:24].decode() for r in OVERFLOWING])
def test_a_number_too_large_for_a_float_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError, match="too large for a float"):
        _parse_reply(raw)


@pytest.mark.parametrize("raw", KEPT, ids=[r[:24].decode() for r in KEPT])
def test_what_fits_is_parsed_as_json_parses_it(raw: bytes) -> None:
    assert _parse_reply(raw) == json.loads(raw)


def _json_numbers() -> st.SearchStrategy[bytes]:
    mantissa = st.from_regex(r"-?[1-9][0-9]{0,3}(\.[0-9]{1,3})?", fullmatch=True)
    exponent = st.from_regex(r"[eE][+-]?0{0,2}[0-9]{1,4}", fullmatch=True)
    return st.builds(lambda m, e: (m + e).encode(), mantissa, st.just("") | exponent)


@settings(max_examples=500, deadline=None)
@given(numbers=st.lists(_json_numbers(), min_size=1, max_size=5), text=st.text(max_size=40))
def test_the_cheap_test_misses_no_overflowing_number(numbers: list[bytes], text: str) -> None:
    raw = b'{"s": ' + json.dumps(text).encode() + b', "n": [' + b", ".join(numbers) + b"]}"
    parsed: Any = json.loads(raw)
    if not _all_finite(parsed):
        assert _may_overflow(raw), raw
        with pytest.raises(ValueError, match="too large for a float"):
            _parse_reply(raw)
    else:
        assert all(math.isfinite(x) for x in parsed["n"])
        assert _parse_reply(raw) == parsed
