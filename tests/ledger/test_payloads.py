"""Payload validation: the hand-checked fast path gives exactly what pydantic gives, or steps aside."""

from __future__ import annotations

import enum
import json
import math
import re
from typing import Any, Literal, get_args, get_origin

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quiesce.ledger import LedgerError
from quiesce.ledger.canonical import canonical_text, canonical_text_of_plain
from quiesce.ledger.payloads import (
    _DECLINE,
    _SPECS,
    PAYLOADS,
    _fast,
    _fast_by_spec,
    validate_payload,
    validate_plain,
)


class Colour(enum.StrEnum):
    RED = "red"


def pydantic_result(kind: str, data: Any) -> Any:
    """The pydantic round trip alone (what validate_payload did before the fast path)."""
    return PAYLOADS[kind].model_validate(data).model_dump(mode="json")


def same_tree(a: Any, b: Any) -> bool:
    """Equal, with the same types at every node and the same key order (== ignores both)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


# Values of every shape a caller might pass: plain JSON, and the near-misses pydantic converts or
# refuses (ints for floats, bools for ints, str subclasses, tuples, non-str keys, bytes, NaN).
leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**60), 2**60)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6)
    | st.sampled_from(["save", "restore", "timeout", "connect", "http", "protocol", "published", "resumed"])
    | st.just(Colour.RED)
    | st.binary(max_size=3)
)
values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=5), children, max_size=3)
        | st.dictionaries(st.integers(0, 3), children, max_size=2)
    ),
    max_leaves=8,
)


plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.floats() | st.text(max_size=6),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)


def fitting(annotation: Any) -> st.SearchStrategy[Any]:
    """Values of the annotation's own type (what the coordinator passes)."""
    if annotation is Any:
        return plain
    if annotation in (str, int, float):
        return {str: st.text(max_size=6), int: st.integers(-(2**60), 2**60), float: st.floats()}[annotation]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(fitting(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(st.text(max_size=5), fitting(args[1]), max_size=3)
    if type(None) in args:
        return st.none() | fitting(next(a for a in args if a is not type(None)))
    return values


@st.composite
def payloads(draw: st.DrawFn) -> tuple[str, dict[Any, Any]]:
    """A kind and a dict over (mostly) its own field names, some left out, maybe an extra one;
    each value mostly of the field's own type, sometimes anything."""
    kind = draw(st.sampled_from(sorted(PAYLOADS)))
    fields = PAYLOADS[kind].model_fields
    data = {
        name: draw(values if draw(st.integers(0, 4)) == 0 else fitting(info.annotation))
        for name, info in fields.items()
        if draw(st.integers(0, 7)) > 0
    }
    if draw(st.integers(0, 9)) == 0:
        data[draw(st.text(max_size=4))] = draw(values)
    return kind, data


@settings(max_examples=1500, deadline=None)
@given(payloads())
def test_fast_path_agrees_with_pydantic(case: tuple[str, dict[Any, Any]]) -> None:
    kind, data = case
    fast = _fast(kind, data)
    by_spec = _fast_by_spec(kind, data)  # the loop the compiled function is generated from
    assert fast is by_spec if by_spec is _DECLINE else same_tree(fast, by_spec)
    try:
        expected = pydantic_result(kind, data)
    except Exception:  # pydantic refuses it: the fast path must have stepped aside
        assert fast is _DECLINE
        with pytest.raises(LedgerError, match=re.escape(f"invalid {kind} payload")):
            validate_payload(kind, data)
        return
    if fast is _DECLINE:
        assert validate_plain(kind, data)[1] is False
        return
    assert same_tree(fast, expected)
    assert validate_plain(kind, data)[1] is True
    try:
        text = canonical_text(expected)
    except (TypeError, ValueError):
        with pytest.raises((TypeError, ValueError)):
            canonical_text(fast)
        with pytest.raises((TypeError, ValueError)):
            canonical_text_of_plain(fast)
    else:
        assert canonical_text(fast) == text
        # what the fast path accepts, orjson writes as it is: the documented encoding, byte for byte
        documented = json.dumps(fast, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        assert canonical_text_of_plain(fast) == documented == text


@settings(max_examples=300, deadline=None)
@given(payloads())
def test_fast_path_shares_nothing_with_the_input(case: tuple[str, dict[Any, Any]]) -> None:
    kind, data = case
    fast = _fast(kind, data)
    if fast is _DECLINE:
        return
    inputs = {id(v) for v in _containers(data)}
    assert not any(id(v) in inputs for v in _containers(fast))


def _containers(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [value, *(c for v in value.values() for c in _containers(v))]
    if isinstance(value, list | tuple):
        return [value, *(c for v in value for c in _containers(v))]
    return []


def test_the_coordinators_payloads_take_the_fast_path() -> None:
    """The events of every save (calls, phases, the attempt's records) skip pydantic."""
    typical: dict[str, dict[str, Any]] = {
        "attempt.started": {
            "kind": "save",
            "deadline_ts": 1.5,
            "participants": ["a", "b"],
            "staging_dir": "/s",
        },
        "phase.started": {"phase": "prepare"},
        "call.sent": {
            "phase": "prepare",
            "method": "POST",
            "path": "/ng-control/v1/agent-checkpoint/prepare",
            "url": "http://127.0.0.1:1/ng-control/v1/agent-checkpoint/prepare",
            "timeout_s": 29.5,
            "body": {"checkpoint_id": "e1-000002", "deadline_ts": 1.5},
        },
        "call.replied": {
            "status": 200,
            "body": {"state": "paused", "workers": {"w0": [1, 2.5]}},
            "elapsed_s": 0.01,
        },
        "call.failed": {"error": "http", "status": 409, "code": "busy", "detail": "no", "elapsed_s": 0.2},
        "phase.completed": {"phase": "commit", "summary": {"agents": {"a": {"records": 4}}}},
        "attempt.publishing": {"staging_dir": "/s", "final_dir": "/f"},
        "attempt.published": {"final_dir": "/f", "manifest_sha256": "0" * 64},
        "attempt.completed": {"servers": ["a", "b"], "outcome": "published"},
        # the unified plane's scope and exports: maps of lists, on every v2 save
        "episodes.scoped": {"scope": ["r1/0", "r2/1"], "source": "given", "restarts": {"env": ["r3/0"]}},
        "episodes.exported": {"exported": {"env": ["r1/0"], "model": [], "agent": ["r1/0", "r2/1"]}},
        "episodes.restored": {"source_checkpoint_id": "c", "scope": ["r1/0"], "restored": {"env": ["r1/1"]}},
    }
    for kind, data in typical.items():
        fast = _fast(kind, data)
        assert fast is not _DECLINE, kind
        assert same_tree(fast, pydantic_result(kind, data)), kind
    # left to pydantic: the kinds with nested models or validators (one of each per attempt at
    # most, or outside any save)
    assert set(PAYLOADS) - set(_SPECS) == {
        "coordinator.started",
        "discovery.completed",
        "episodes.blocked",
        "rollouts.captured",
        "rollouts.acknowledged",
        "rollouts.continued",
    }


def test_floats_that_json_writes_with_an_exponent_go_to_pydantic_and_come_back_the_same() -> None:
    """The fast path accepts only floats that orjson writes as json does (0, or 1e-4 <= |x| < 1e16);
    the others are pydantic's, which gives the same copy, encoded by json."""
    for value in (1e16, -1e16, 1.5e300, 5e-324, 9.999999999999999e-05, -1e-05, 1e22):
        data = {"status": 200, "body": {"t": value}, "elapsed_s": 0.5}
        assert _fast("call.replied", data) is _DECLINE, value
        stored, plain = validate_plain("call.replied", data)
        assert plain is False
        assert stored == data
        assert canonical_text(stored) == json.dumps(stored, sort_keys=True, separators=(",", ":"))
        data = {"status": 200, "body": None, "elapsed_s": value}
        assert _fast("call.replied", data) is _DECLINE, value
    for value in (0.0, -0.0, 1e-4, 9999999999999998.0, 1760000000.25, 0.1):
        data = {"status": 200, "body": {"t": [value]}, "elapsed_s": value}
        fast = _fast("call.replied", data)
        assert fast is not _DECLINE, value
        assert fast == data
        assert canonical_text_of_plain(fast) == json.dumps(fast, sort_keys=True, separators=(",", ":"))


def test_near_misses_go_to_pydantic_and_come_back_converted() -> None:
    """pydantic's conversions still happen: through pydantic, not the hand check."""
    sent = {"phase": "p", "method": "GET", "path": "/x", "url": "http://h/x", "timeout_s": 5, "body": None}
    assert _fast("call.sent", sent) is _DECLINE  # an int for a float
    assert validate_payload("call.sent", sent)["timeout_s"] == 5.0
    assert type(validate_payload("call.sent", sent)["timeout_s"]) is float
    replied = {"status": 200, "body": {"ids": (1, 2)}, "elapsed_s": 0.5}
    assert _fast("call.replied", replied) is _DECLINE  # a tuple in the body
    assert validate_payload("call.replied", replied)["body"] == {"ids": [1, 2]}
    with pytest.raises(LedgerError, match=r"invalid call\.replied payload: extra"):
        validate_payload("call.replied", {**replied, "extra": 1})
    with pytest.raises(LedgerError, match=r"invalid phase\.started payload: phase: Field required"):
        validate_payload("phase.started", {})
    # valid for pydantic, but its JSON dump fails: a clear error, not a UnicodeDecodeError
    with pytest.raises(LedgerError, match=r"invalid call\.replied payload: a value cannot be stored as JSON"):
        validate_payload("call.replied", {**replied, "body": b"\x80"})


def test_a_body_nested_too_deep_for_the_hand_check_goes_to_pydantic() -> None:
    deep: Any = "leaf"
    for _ in range(5000):
        deep = [deep]
    replied = {"status": 200, "body": deep, "elapsed_s": 0.5}
    assert _fast("call.replied", replied) is _DECLINE
    try:
        expected: Any = pydantic_result("call.replied", replied)
    except Exception:  # pydantic refuses it (its recursion limit): a clear error, not a crash
        with pytest.raises(LedgerError, match=r"invalid call\.replied payload"):
            validate_payload("call.replied", replied)
    else:
        assert validate_payload("call.replied", replied) == expected


def test_fast_path_defaults_are_pydantics_and_never_shared() -> None:
    # every optional field of every kind the fast path takes, left out: its default is the value
    # pydantic gives, and a mutable default is a new object each time (two payloads never share it)
    checked = 0
    for kind, model in PAYLOADS.items():
        required = {
            n: _sample(info.annotation) for n, info in model.model_fields.items() if info.is_required()
        }
        first, second = _fast(kind, dict(required)), _fast(kind, dict(required))
        if first is _DECLINE:
            continue
        expected = pydantic_result(kind, dict(required))
        assert same_tree(first, expected), kind
        for name, info in model.model_fields.items():
            if info.is_required():
                continue
            checked += 1
            if isinstance(first[name], list | dict):
                assert first[name] is not second[name], (kind, name)
                first[name].append(1) if isinstance(first[name], list) else first[name].update(x=1)
                assert _fast(kind, dict(required))[name] == expected[name], (kind, name)
    assert checked >= 20  # the kinds above have that many optional fields


def _sample(annotation: Any) -> Any:
    """A value that fits a field of the fast path's simple types (what `_check_for` takes)."""
    if annotation in (str, int, float, bool):
        return {str: "x", int: 1, float: 1.5, bool: True}[annotation]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return args[0]
    return {list: [], dict: {}}.get(origin)  # None for Any and for an optional field
