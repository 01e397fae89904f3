"""The payload models: one pydantic model per event kind, and validation of a payload to append.

Only writers need them (``Ledger.append`` validates against them); they are loaded on a ledger's
first append, so opening a ledger to read builds none of them. ``quiesce.ledger.events`` re-exports every
name. ``PAYLOADS`` covers exactly ``quiesce.ledger.events.KINDS`` (checked by the tests).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Final, Literal, TypeAlias, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quiesce.ledger.canonical import FIXED_FLOAT_HI as _FIXED_HI
from quiesce.ledger.canonical import FIXED_FLOAT_LO as _FIXED_LO
from quiesce.ledger.errors import LedgerError

__all__ = [
    "PAYLOADS",
    "AttemptAborted",
    "AttemptAborting",
    "AttemptCompleted",
    "AttemptPublished",
    "AttemptPublishing",
    "AttemptStarted",
    "CallFailed",
    "CallReplied",
    "CallSent",
    "CoordinatorId",
    "CoordinatorStarted",
    "DiscoveryCompleted",
    "EpisodesBlocked",
    "EpisodesExported",
    "EpisodesRestored",
    "EpisodesRetired",
    "EpisodesScoped",
    "NamedReason",
    "Participant",
    "Payload",
    "PhaseCompleted",
    "PhaseFailed",
    "PhaseStarted",
    "RecoveryCompleted",
    "RecoverySettled",
    "RecoveryStarted",
    "RolloutAttempt",
    "RolloutsAcknowledged",
    "RolloutsCaptured",
    "RolloutsContinued",
    "RolloutsForgotten",
    "validate_payload",
]


class Payload(BaseModel):
    """Base of every payload model: unknown fields are refused on write."""

    model_config = ConfigDict(extra="forbid", defer_build=True)


# -- coordinator and discovery ------------------------------------------------------------


class CoordinatorId(Payload):
    host: str
    pid: int
    uuid: str


class CoordinatorStarted(Payload):
    coordinator: CoordinatorId
    version: str


class Participant(Payload):
    name: str
    component: str
    mode: str
    role: str | None = None
    url: str
    #: the control plane it speaks: `v1` (per-component routes) or `v2` (Gym's unified plane)
    plane: Literal["v1", "v2"] = "v1"
    #: v1: its capability `features` (the lineage reads `completed_result_acknowledgement`: an
    #: agent with it reports every finished result, so a rollout it drops is seen lost)
    features: list[str] = []
    #: its folder inside every snapshot (`ServerConfig.folder`; "": the snapshot itself)
    folder: str = ""
    #: v1 with a folder: the name it reports and writes under, when not its config name ("": that)
    reported_name: str = ""


class NamedReason(Payload):
    name: str
    reason: str


class DiscoveryCompleted(Payload):
    participants: list[Participant]
    skipped: list[NamedReason] = []
    refused: list[NamedReason] = []
    warnings: list[str] = []


# -- attempts -------------------------------------------------------------------------------


class AttemptStarted(Payload):
    kind: Literal["save", "restore"]
    deadline_ts: float
    participants: list[str]
    staging_dir: str | None = None
    snapshot_dir: str | None = None
    source_checkpoint_id: str | None = None
    #: restore only: sha256 of the snapshot's manifest when the restore began (a re-driven restore
    #: refuses a snapshot whose manifest changed since)
    manifest_sha256: str | None = None
    #: what the coordinator warned of before the first request (preflight; an unrecorded snapshot)
    warnings: list[str] = []
    #: restore only: the caller asked for a resume once restored (the restore is not terminal
    #: until that resume finished; recovery finishes it)
    resume: bool = False
    #: the control plane of its participants (`v2`: Gym's unified plane)
    plane: Literal["v1", "v2"] = "v1"
    #: save only: committed into its caller's folder (`staging_dir`) and published there in place
    in_place: bool = False
    #: save, v2: commit with `stop` — the servers stay paused for shutdown once published
    stop: bool = False
    #: restore, v1: the cluster's `restart_only` resources servers when it began — the restored
    #: continuations that depend on one are discarded (a re-driven restore uses the same set)
    restart_only: list[str] = []
    #: restore, v1: the agents that can discard a restored continuation (Gym's features
    #: `discard_restored_continuation_v1`, `agent_resource_dependency_index_v1`)
    discarding: list[str] = []


class PhaseStarted(Payload):
    phase: str
    #: a run of the phase that works to its own budget, not the attempt's `deadline_ts` (a
    #: restore re-driven under its id: `quiesce.coordinator.restore.redrive`)
    deadline_ts: float | None = None
    #: commit of a save started in place with no folder yet: the folder it commits into and is
    #: published in (recorded durably before anything is created there)
    staging_dir: str | None = None


class CallSent(Payload):
    phase: str
    method: str
    path: str
    url: str
    timeout_s: float
    body: Any = None


class CallReplied(Payload):
    status: int
    body: Any = None
    elapsed_s: float


class CallFailed(Payload):
    error: Literal["timeout", "connect", "http", "protocol"]
    status: int | None = None
    code: str | None = None
    detail: str
    elapsed_s: float


class PhaseCompleted(Payload):
    phase: str
    summary: dict[str, Any] = {}


class PhaseFailed(Payload):
    phase: str
    server: str | None = None
    reason: str
    code: str | None = None


class AttemptPublishing(Payload):
    staging_dir: str
    final_dir: str


class AttemptPublished(Payload):
    final_dir: str
    manifest_sha256: str


class AttemptAborting(Payload):
    reason: str


class AttemptAborted(Payload):
    reason: str
    resumed: list[str] = []
    left_paused: list[str] = []
    not_paused: list[str] = []


class AttemptCompleted(Payload):
    servers: list[str]
    outcome: Literal["published", "restored", "resumed"]


# -- recovery -------------------------------------------------------------------------------


class RecoveryStarted(Payload):
    attempts: list[str]


class RecoverySettled(Payload):
    reported_phase: str | None = None
    active_checkpoint_id: str | None = None
    action: str
    result: str


class RecoveryCompleted(Payload):
    outcomes: dict[str, str]


# -- episodes (Gym's unified plane): what each attempt covered, so a lineage can be rebuilt ------
#
# Episodes are written as capture keys (`<rollout_id>` for attempt 0, `<rollout_id>-a<n>` after).


class EpisodesBlocked(Payload):
    """A prepare that was not ready: per server, the blockers it listed and their full count."""

    blockers: dict[str, list[str]]
    counts: dict[str, int]


class EpisodesScoped(Payload):
    """The commit scope of a save, before its commit is sent: the episodes the caller continues
    (`given`: named by the caller; else derived from what the servers exported), and the
    restarts each server reported, which are left out of it."""

    scope: list[str]
    source: Literal["given", "derived"]
    restarts: dict[str, list[str]] = {}


class EpisodesExported(Payload):
    """What each server's commit exported (its reply's `episode_ids`)."""

    exported: dict[str, list[str]]


class EpisodesRestored(Payload):
    """A restore's inventory and, per server, the next attempts it restored."""

    source_checkpoint_id: str
    scope: list[str]
    restored: dict[str, list[str]]


class EpisodesRetired(Payload):
    """Attempts retired everywhere (`servers`, in call order): by request, or to clean up a
    failed restore (`reason`)."""

    episodes: list[str]
    servers: list[str]
    reason: str
    failed: dict[str, str] = {}


class RolloutsForgotten(Payload):
    rollout_ids: list[str]
    servers: list[str]
    failed: dict[str, str] = {}


# -- rollouts (plane v1): the same lineage facts, as explicit (rollout id, attempt) pairs ---------
#
# v1's rollout ids may end in `-a<N>`, so a capture key would not say which attempt it names.


class RolloutAttempt(Payload):
    """One execution: attempt `attempt` (Gym's `attempt_index`) of rollout `rollout_id`."""

    rollout_id: str
    attempt: Annotated[int, Field(ge=0)]


class RolloutsCaptured(Payload):
    """A v1 save's commit: per agent, the executions its continuation index lists (one per parked
    rollout, each with its boundary record), read from the committed file once its sha256 and
    record count matched the agent's reply. Appended before the commit phase completes."""

    captured: dict[str, list[RolloutAttempt]]


class RolloutsAcknowledged(Payload):
    """v1: the finished executions agent `server` released when the caller acknowledged them
    (its reply's `acknowledged`, which is the requested set)."""

    executions: list[RolloutAttempt]


class RolloutsContinued(Payload):
    """A v1 restore whose restore phase succeeded: per agent, the executions it continues (each
    saved record's rollout as attempt n+1 — the caller sends its `/run` again); the continuations
    discarded because they depend on a `restart_only` resources server (they start over); and
    the agents whose saved records could not be read, with the reason."""

    source_checkpoint_id: str
    continued: dict[str, list[RolloutAttempt]]
    discarded: dict[str, list[RolloutAttempt]] = {}
    unknown: dict[str, str] = {}


#: kind -> payload model. The vocabulary; ``Ledger.append`` refuses any other kind.
PAYLOADS: Final[dict[str, type[Payload]]] = {
    "coordinator.started": CoordinatorStarted,
    "discovery.completed": DiscoveryCompleted,
    "attempt.started": AttemptStarted,
    "phase.started": PhaseStarted,
    "call.sent": CallSent,
    "call.replied": CallReplied,
    "call.failed": CallFailed,
    "phase.completed": PhaseCompleted,
    "phase.failed": PhaseFailed,
    "attempt.publishing": AttemptPublishing,
    "attempt.published": AttemptPublished,
    "attempt.aborting": AttemptAborting,
    "attempt.aborted": AttemptAborted,
    "attempt.completed": AttemptCompleted,
    "recovery.started": RecoveryStarted,
    "recovery.settled": RecoverySettled,
    "recovery.completed": RecoveryCompleted,
    "episodes.blocked": EpisodesBlocked,
    "episodes.scoped": EpisodesScoped,
    "episodes.exported": EpisodesExported,
    "episodes.restored": EpisodesRestored,
    "episodes.retired": EpisodesRetired,
    "rollouts.forgotten": RolloutsForgotten,
    "rollouts.captured": RolloutsCaptured,
    "rollouts.acknowledged": RolloutsAcknowledged,
    "rollouts.continued": RolloutsContinued,
}


def _format_validation(kind: str, error: ValidationError) -> str:
    # Never include the input: it may hold a secret the redactor has not seen yet.
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(payload)'}: {e['msg']}"
        for e in error.errors(include_input=False, include_url=False)
    )
    return f"invalid {kind} payload: {problems}"


# -- the fast path -------------------------------------------------------------------------
#
# A payload the coordinator builds is a plain dict of plain JSON values, and pydantic's validation
# plus its JSON-mode dump of such a dict is a copy of it with the defaults filled in. Done by hand
# for the kinds whose fields have simple types, that costs a fraction of the pydantic round trip
# on every event (the hot path of a save). The hand check only ever *accepts* a payload whose
# pydantic result is known to be that copy — exact types only (``type(v) is float``: an int given
# for a float field, a bool for an int, a str subclass, a tuple in a body all go to pydantic) —
# and hands everything else to pydantic, which gives the result or the error it always gave.
# ``tests/ledger/test_payloads.py`` checks the two agree on generated payloads.
#
# It also accepts only floats that are 0 or that ``repr`` writes without an exponent (pydantic
# decides the rest: the same copy, more slowly), so that what it accepts is, as it is, a value
# whose canonical text orjson writes (``quiesce.ledger.canonical.canonical_text_of_plain``).

_Check: TypeAlias = Callable[[Any], Any]
_DECLINE: Final = object()  # a check's "not sure": pydantic decides


def _plain(value: Any) -> Any:
    """A copy of ``value`` if it is plain JSON (dict with str keys, list, str, int, float, bool,
    None: exact types; every float 0 or written without an exponent), else ``_DECLINE``. (pydantic
    dumps an infinite or NaN float as null: that conversion stays pydantic's.)"""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if kind is float:
        return value if value == 0.0 or _FIXED_LO <= abs(value) < _FIXED_HI else _DECLINE
    # containers: their scalar items are checked in place (most of a reply body's values are
    # scalars: a call per value would cost more than the copy)
    if kind is dict:
        out: dict[str, Any] = {}
        for key, item in value.items():
            if type(key) is not str:
                return _DECLINE
            inner = type(item)
            if inner is str or inner is int or inner is bool or item is None:
                out[key] = item
                continue
            copied = _plain(item)
            if copied is _DECLINE:
                return _DECLINE
            out[key] = copied
        return out
    if kind is list:
        items: list[Any] = []
        for item in value:
            inner = type(item)
            if inner is str or inner is int or inner is bool or item is None:
                items.append(item)
                continue
            copied = _plain(item)
            if copied is _DECLINE:
                return _DECLINE
            items.append(copied)
        return items
    return _DECLINE


def _exact(expected: type) -> _Check:
    if expected is float:
        return lambda value: (
            value
            if type(value) is float and (value == 0.0 or _FIXED_LO <= abs(value) < _FIXED_HI)
            else _DECLINE
        )
    return lambda value: value if type(value) is expected else _DECLINE


def _check_for(annotation: Any) -> _Check | None:
    """The hand check of a field annotation, or None when the annotation is not a simple one."""
    if annotation is Any:
        return _plain
    if annotation in (str, int, float, bool):
        return _exact(annotation)
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal and all(type(a) is str for a in args):
        allowed = frozenset(args)
        return lambda value: value if type(value) is str and value in allowed else _DECLINE
    if origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = _check_for(next(a for a in args if a is not type(None)))
        if inner is not None:
            check = inner
            return lambda value: None if value is None else check(value)
    if origin is list and args == (str,):
        return lambda value: (
            list(value) if type(value) is list and all(type(v) is str for v in value) else _DECLINE
        )
    if origin is dict and args in ((str, Any), (str, str)):
        values_str = args[1] is str
        return lambda value: (
            _DECLINE
            if type(value) is not dict or (values_str and any(type(v) is not str for v in value.values()))
            else _plain(value)
        )
    if origin is dict and len(args) == 2 and args[0] is str and get_origin(args[1]) is list:
        each = _check_for(args[1])  # e.g. dict[str, list[str]]: lists of episode ids per server
        if each is not None:
            return functools.partial(_dict_of, each)
    return None


def _dict_of(each: _Check, value: Any) -> Any:
    """A new dict of ``value``'s str keys to ``each(item)``, or ``_DECLINE``."""
    if type(value) is not dict:
        return _DECLINE
    out: dict[str, Any] = {}
    for key, item in value.items():
        if type(key) is not str:
            return _DECLINE
        checked = each(item)
        if checked is _DECLINE:
            return _DECLINE
        out[key] = checked
    return out


#: A field's default as pydantic's ``get_default(call_default_factory=True)`` gives it: a new
#: object each call for a mutable one (nothing is shared between two payloads).
_Default: TypeAlias = Callable[[], Any]
#: kind -> (name, check, required, default) per field in model order, and the field names; a kind
#: whose model has a field of another type (or any validator) has no entry and always goes to
#: pydantic.
_SPECS: dict[str, tuple[tuple[tuple[str, _Check, bool, _Default], ...], frozenset[str]]] = {}


def _default_of(info: Any) -> _Default:
    """The default of a field without pydantic's call per use: an immutable value as it is, an
    empty list or dict anew (what pydantic's copy of it is); anything else through pydantic."""
    if info.default_factory is None:
        value = info.default
        if value is None or type(value) in (str, int, float, bool):
            return lambda: value
        if type(value) in (list, dict) and not value:
            return type(value)
    return lambda: info.get_default(call_default_factory=True)


def _build_specs() -> None:
    for kind, model in PAYLOADS.items():
        decorators = model.__pydantic_decorators__
        if any((decorators.validators, decorators.field_validators, decorators.root_validators,
                decorators.model_validators, decorators.field_serializers, decorators.model_serializers,
                decorators.computed_fields)):  # fmt: skip
            continue
        fields = []
        for name, info in model.model_fields.items():
            check = _check_for(info.annotation)
            if check is None or info.alias is not None:
                break
            fields.append((name, check, info.is_required(), _default_of(info)))
        else:
            _SPECS[kind] = (tuple(fields), frozenset(model.model_fields))
            _VALIDATORS[kind] = _compile(kind, model)


#: kind -> its fast path (``_compile``), for the kinds of ``_SPECS``.
_VALIDATORS: dict[str, _Check] = {}
_MISSING: Final = object()


#: The test of a field's value ``x`` written inline by ``_compile``, per exact annotation.
_INLINE: Final[dict[Any, str]] = {
    str: "type(x) is str",
    int: "type(x) is int",
    bool: "type(x) is bool",
    float: "type(x) is float and (x == 0.0 or _LO <= abs(x) < _HI)",
}


def _compile(kind: str, model: type[BaseModel]) -> _Check:
    """The fast path of ``kind`` as one function, generated from ``_SPECS[kind]``: the same checks
    in the same field order as the loop over the spec (``_fast_by_spec``, which the tests hold it
    to), with the exact-type tests of str, int, bool and float fields written inline, which costs
    about a fifth less per payload than the loop's call per field."""
    fields, names = _SPECS[kind]
    env: dict[str, Any] = {"_D": _DECLINE, "_M": _MISSING, "_names": names}
    env["_LO"], env["_HI"] = _FIXED_LO, _FIXED_HI
    lines = ["def validate(data):", "    if not _names.issuperset(data):", "        return _D"]
    lines.append("    out = {}")
    for index, (name, check, required, default) in enumerate(fields):
        env[f"_check{index}"], env[f"_default{index}"] = check, default
        key = repr(name)
        missing = "return _D" if required else f"out[{key}] = _default{index}()"
        lines += [f"    x = data.get({key}, _M)", "    if x is _M:", f"        {missing}"]
        inline = _INLINE.get(model.model_fields[name].annotation)
        if inline is not None:
            lines += [f"    elif {inline}:", f"        out[{key}] = x", "    else:", "        return _D"]
        else:
            lines += ["    else:", f"        x = _check{index}(x)", "        if x is _D:"]
            lines += ["            return _D", f"        out[{key}] = x"]
    lines.append("    return out")
    exec(compile("\n".join(lines), f"<fast path of {kind}>", "exec"), env)
    validate: _Check = env["validate"]
    return validate


_build_specs()


def _fast_by_spec(kind: str, data: dict[Any, Any]) -> Any:
    """What pydantic's validate-and-dump would return for ``data``, or ``_DECLINE``: the spec's
    checks in a loop (the definition ``_compile``'s functions are held to)."""
    spec = _SPECS.get(kind)
    if spec is None:
        return _DECLINE
    fields, names = spec
    if not names.issuperset(data):  # a key the model does not have
        return _DECLINE
    out: dict[str, Any] = {}
    for name, check, required, default in fields:
        if name in data:
            try:
                value = check(data[name])
            except RecursionError:  # nested deeper than the stack allows: as deep as pydantic goes
                return _DECLINE
            if value is _DECLINE:
                return _DECLINE
            out[name] = value
        elif required:
            return _DECLINE
        else:
            out[name] = default()
    return out


def _fast(kind: str, data: dict[Any, Any]) -> Any:
    """What pydantic's validate-and-dump would return for ``data``, or ``_DECLINE``: the compiled
    fast path (``validate_plain``'s first step)."""
    validate = _VALIDATORS.get(kind)
    if validate is None:
        return _DECLINE
    try:
        return validate(data)
    except RecursionError:  # nested deeper than the stack allows: as deep as pydantic goes
        return _DECLINE


def validate_payload(kind: str, data: Any) -> Any:
    """``data`` (a mapping or a pydantic model) validated against the model of ``kind`` (one of
    ``PAYLOADS``), as JSON-ready data; ``LedgerError`` when it does not fit.

    The result is always a new object (nothing of ``data`` is shared with it)."""
    return validate_plain(kind, data)[0]


def validate_plain(kind: str, data: Any) -> tuple[Any, bool]:
    """``validate_payload(kind, data)``, and whether the fast path gave it: then it is plain JSON
    of exact types whose every float is 0 or written without an exponent, which
    ``quiesce.ledger.canonical.canonical_text_of_plain`` may encode as it is."""
    if type(data) is dict:
        fast = _fast(kind, data)
        if fast is not _DECLINE:
            return fast, True
    model = PAYLOADS[kind]
    try:
        if isinstance(data, model):
            return data.model_dump(mode="json"), False
        if isinstance(data, BaseModel):
            return model.model_validate(data.model_dump(mode="json")).model_dump(mode="json"), False
        if isinstance(data, Mapping):
            return model.model_validate(data).model_dump(mode="json"), False
        raise LedgerError(
            f"a {kind} payload must be a mapping or a {model.__name__}, not {type(data).__name__}"
        )
    except ValidationError as error:
        raise LedgerError(_format_validation(kind, error)) from None
    except (ValueError, TypeError) as error:  # valid, but its dump failed (bytes that are not UTF-8, ...)
        raise LedgerError(
            f"invalid {kind} payload: a value cannot be stored as JSON ({type(error).__name__})"
        ) from None
