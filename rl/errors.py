"""The one error the NeMo RL backend raises: `EnvironmentCheckpointError`, picklable (it crosses
Ray), carrying the operation, the server at fault (when one is), a short stable code, and whether
trying again may succeed.

The classification mirrors NeMo RL's `is_transient_gym_checkpoint_failure`
(`nemo_rl/environments/gym_checkpoint_coordinator.py` @448b0253): participants not ready in
time, calls that went unanswered, actors or control planes that failed a call are transient (they
leave nothing behind: the backend resumes, and Gym's lease reopens a server if that resume is lost
too); anything else — a malformed reply, a topology or ownership mismatch, a broken invariant — is
permanent, since a retry would only hide it. A group of failures is transient only when it is not
empty and every one of them is. quiesce's own errors extend it: servers held by another
checkpoint, a lease that ran out, another operation still open and a deadline that passed are
transient; a bad config, a refused token, a fenced coordinator, a ledger that cannot be written or
does not verify, and a snapshot that fails verification are permanent.

Codes (`CODES` maps each to its classification):

    transient   not_ready timeout connection unavailable servers_held busy lease_lost
    permanent   malformed_reply refused unauthorized config discovery fenced ledger_tampered
                ledger_unavailable missing_extra snapshot_invalid acknowledgement cut_mismatch
                phase_failed invariant failed

A message never holds the control token: quiesce's errors never carry it, and every message is
passed through the ledger's redaction (the secrets given, URL passwords, `Bearer <...>`) anyway.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from quiesce.coordinator.errors import (
    AcknowledgementError,
    ConfigError,
    DeadlineExceeded,
    DiscoveryError,
    FencedError,
    LedgerError,
    MissingExtra,
    PhaseError,
    QuiesceError,
    ServersHeld,
    SnapshotError,
)
from quiesce.coordinator.http import BadReply, ConnectFailed, ConnectionLost, ConnectTimeout, ReplyTimeout
from quiesce.ledger.errors import BrokenChainError, LedgerUrlError
from quiesce.ledger.redact import Redactor

__all__ = ["CODES", "EnvironmentCheckpointError", "from_quiesce", "is_transient"]

#: Each code and whether an error with it may succeed when simply tried again.
CODES: Final[Mapping[str, bool]] = {
    "not_ready": True,
    "timeout": True,
    "connection": True,
    "unavailable": True,
    "servers_held": True,
    "busy": True,
    "lease_lost": True,
    "malformed_reply": False,
    "refused": False,
    "unauthorized": False,
    "config": False,
    "discovery": False,
    "fenced": False,
    "ledger_tampered": False,
    "ledger_unavailable": False,
    "missing_extra": False,
    "snapshot_invalid": False,
    "acknowledgement": False,
    "cut_mismatch": False,
    "phase_failed": False,
    "invariant": False,
    "failed": False,
}

_CODE: Final = re.compile(r"[a-z][a-z0-9_]*")
#: An HTTP bearer credential as a header shows it (`Bearer <credential>`; not prose's "bearer token").
_BEARER: Final = re.compile(r"\b(Bearer\s+)(?!<redacted>|tokens?\b)[^\s\"',;]+")


def _clean(message: str, secrets: Sequence[str]) -> str:
    """`message` with every secret, URL password and bearer credential replaced by `<redacted>`."""
    return _BEARER.sub(r"\1<redacted>", Redactor(secrets).text(message))


class EnvironmentCheckpointError(Exception):
    """An environment checkpoint operation failed.

    `operation` (snapshot, commit, restore, resume, retire, forget, prepare, renew, recover, ...),
    `server` (the Gym server at fault, None when no one server is), `code` (lowercase, see the
    module docstring) and `transient` (trying again may succeed). `str()` is the message, from
    which `secrets` were removed. Pickles to an error with the same type, message, fields and
    notes."""

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        code: str,
        transient: bool,
        server: str | None = None,
        secrets: Sequence[str] = (),
    ) -> None:
        if not isinstance(operation, str) or not operation:
            raise ValueError("an environment checkpoint error names its operation")
        if not isinstance(code, str) or not _CODE.fullmatch(code):
            raise ValueError(f"an error code is lowercase letters, digits and '_', not {code!r}")
        if not isinstance(transient, bool):
            raise TypeError("transient must be true or false")
        if server is not None and (not isinstance(server, str) or not server):
            raise ValueError("server must be a non-empty string or None")
        message = _clean(str(message), secrets)
        super().__init__(message)
        self.message = message
        self.operation = operation
        self.server = server
        self.code = code
        self.transient = transient

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.message!r}, operation={self.operation!r},"
            f" server={self.server!r}, code={self.code!r}, transient={self.transient!r})"
        )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        fields = (type(self), self.message, self.operation, self.server, self.code, self.transient)
        return (_rebuild, fields, dict(self.__dict__))


def _rebuild(
    cls: type[EnvironmentCheckpointError],
    message: str,
    operation: str,
    server: str | None,
    code: str,
    transient: bool,
) -> EnvironmentCheckpointError:
    """Unpickle: the error as it was built (its message is already clean)."""
    return cls(message, operation=operation, code=code, transient=transient, server=server)


# ---------------------------------------------------------------------------------------------
# Classification
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Class:
    """A judged failure: its code, whether it is transient (the code's, unless an error of ours
    said otherwise), and the server it names."""

    code: str
    server: str | None = None
    transient: bool | None = None

    def __post_init__(self) -> None:
        if self.transient is None:
            object.__setattr__(self, "transient", CODES[self.code])


#: Envelope codes of a Gym refusal (`PhaseError.code`) with a classification of their own.
_ENVELOPE: Final[Mapping[str, str]] = {
    "checkpoint_conflict": "servers_held",  # another checkpoint id holds the server
    "stale_checkpoint": "lease_lost",  # the id was resumed (or its lease ran out) meanwhile
    "invalid_phase": "lease_lost",  # the server is not where the id left it: let go, or not yet free
    "deadline_exceeded": "timeout",
    "unauthorized": "unauthorized",
}
#: `CallResult.describe()` inside a phase's reason: `<what> failed: <error class> ...`.
_CALL_ERROR: Final = re.compile(r"\bfailed: (timeout|connect|protocol|http)\b")
_UNAUTHORIZED: Final = re.compile(r"\bfailed: http 401\b")
_CALL_CODE: Final[Mapping[str, str]] = {
    "timeout": "timeout",
    "connect": "connection",
    "protocol": "malformed_reply",
    "http": "refused",
}
#: What quiesce says when a server let go of a save (renewal refused, prepare answered another phase).
_LEASE_LOST: Final = re.compile(r"(?:^|: )(\S+) no longer holds checkpoint |let go of this checkpoint")
#: What quiesce says when servers are held by another checkpoint, or this coordinator is busy.
_HELD: Final = re.compile(r"\bis \w+ under checkpoint \S+|Gym refuses both until then")
_BUSY: Final = re.compile(r"\bresume or abort it first\b|\bwhile checkpoint \S+ is open\b")
#: Ray's exceptions that mean an actor, node, worker or object went away, or a call timed out:
#: named, so that this module imports nothing of Ray (subclasses count: the whole MRO is read).
_RAY_INFRA: Final = frozenset(
    {
        "RayActorError",
        "GetTimeoutError",
        "NodeDiedError",
        "WorkerCrashedError",
        "LocalRayletDiedError",
        "ObjectLostError",
        "OutOfMemoryError",
        "ObjectStoreFullError",
        "PendingCallsLimitExceeded",
        "RpcError",
        "RayChannelTimeoutError",
    }
)
_RAY_PERMANENT: Final = frozenset({"ReferenceCountingAssertionError", "ObjectFreedError"})


def _names(error: BaseException) -> set[str]:
    """The class names in `error`'s MRO that come from Ray."""
    return {c.__name__ for c in type(error).__mro__ if c.__module__.split(".")[0] == "ray"}


def _classify_phase(error: PhaseError) -> _Class:
    reason = error.reason or str(error)
    if _LEASE_LOST.search(reason):
        return _Class("lease_lost", error.server)
    if isinstance(error, DeadlineExceeded):
        ready = reason.startswith("not ready") or "never became ready" in reason
        return _Class("not_ready" if ready else "timeout", error.server)
    envelope = _ENVELOPE.get(error.code or "")
    if envelope is not None:
        return _Class(envelope, error.server)
    if _UNAUTHORIZED.search(reason):
        return _Class("unauthorized", error.server)
    call = _CALL_ERROR.search(reason)
    if call is not None:
        return _Class(_CALL_CODE[call.group(1)], error.server)
    return _Class("phase_failed", error.server)


def _classify_quiesce(error: QuiesceError) -> _Class:
    if isinstance(error, FencedError):
        return _Class("fenced")
    if isinstance(error, BrokenChainError):
        return _Class("ledger_tampered")
    if isinstance(error, LedgerUrlError):
        return _Class("config")
    if isinstance(error, LedgerError):  # LedgerStranded: the ledger stopped taking writes
        return _Class("ledger_unavailable")
    if isinstance(error, MissingExtra):
        return _Class("missing_extra")
    if isinstance(error, ConfigError):
        return _Class("config")
    if isinstance(error, DiscoveryError):
        server = error.reasons[0][0] if error.reasons else None
        unreachable = bool(error.reasons) and all(
            why.startswith("cannot be reached") for _, why in error.reasons
        )
        return _Class("connection" if unreachable else "discovery", server)
    if isinstance(error, ServersHeld):
        return _Class("servers_held", min(error.held) if error.held else None)
    if isinstance(error, SnapshotError):
        return _Class("snapshot_invalid")
    if isinstance(error, AcknowledgementError):
        return _Class("acknowledgement", error.server)
    if isinstance(error, PhaseError):
        return _classify_phase(error)
    text = str(error)
    lost = _LEASE_LOST.search(text)
    if lost is not None:
        return _Class("lease_lost", lost.group(1))
    if _HELD.search(text):
        return _Class("servers_held")
    if _BUSY.search(text):
        return _Class("busy")
    return _Class("failed")


def _unwrap(error: BaseException) -> BaseException:
    """What a remote call raised, when `error` is Ray's `RayTaskError` around it (its `cause`)."""
    for _ in range(16):  # a wrapper of a wrapper: never a cycle
        cause = getattr(error, "cause", None)
        if "RayTaskError" not in _names(error) or not isinstance(cause, BaseException) or cause is error:
            break
        error = cause
    return error


def _classify(error: BaseException) -> _Class:
    error = _unwrap(error)
    if isinstance(error, EnvironmentCheckpointError):
        return _Class(error.code, error.server, error.transient)
    names = _names(error)
    if isinstance(error, QuiesceError):
        return _classify_quiesce(error)
    if isinstance(error, BaseExceptionGroup):
        return _classify_all(list(error.exceptions))
    failures = getattr(error, "failures", None)  # RL's GymCheckpointOperationError
    if isinstance(failures, Mapping) and all(isinstance(f, BaseException) for f in failures.values()):
        return _classify_all([failures[k] for k in sorted(failures)], servers=sorted(failures))
    kind = type(error).__name__
    if kind == "GymCheckpointNotReady":
        return _Class("not_ready")
    if kind == "GymCheckpointUnavailable":
        return _Class("unavailable")
    if names & _RAY_PERMANENT:
        return _Class("invariant")
    if isinstance(error, TimeoutError | ConnectTimeout | ReplyTimeout):
        return _Class("timeout")
    if names & _RAY_INFRA:
        return _Class("unavailable")
    if isinstance(error, ConnectionError | ConnectFailed | ConnectionLost):
        return _Class("connection")
    if isinstance(error, BadReply):
        return _Class("malformed_reply")
    return _Class("invariant")


def _classify_all(errors: Sequence[BaseException], servers: Sequence[str] | None = None) -> _Class:
    """Several failures of one operation: transient only when there are some and every one is;
    the code and server of the first permanent one (else the first one's)."""
    if not errors:
        return _Class("invariant")
    judged = [_classify(e) for e in errors]
    first = next((c for c in judged if not c.transient), judged[0])
    server = first.server
    if server is None and servers is not None:
        server = servers[judged.index(first)]
    return _Class(first.code, server, all(c.transient for c in judged))


def is_transient(error: BaseException) -> bool:
    """Whether `error` may go away when the operation is simply tried again (the module docstring
    gives the rules). An `EnvironmentCheckpointError` answers its own `transient`."""
    return bool(_classify(error).transient)


def from_quiesce(
    operation: str, error: BaseException, *, secrets: Sequence[str] = ()
) -> EnvironmentCheckpointError:
    """`error` (raised by quiesce, Ray, RL or anything beneath) as the backend's error for
    `operation`: its code and classification by the rules of the module docstring, the server the
    error names (a phase's server, the first held or failed one), and its message with `secrets`
    removed. An `EnvironmentCheckpointError` is returned as it is (unwrapped from Ray's
    `RayTaskError`, as every error is judged by what the remote call raised). Raise the result
    `from error`: the cause stays local (it is not pickled)."""
    error = _unwrap(error)
    if isinstance(error, EnvironmentCheckpointError):
        return error
    judged = _classify(error)
    text = str(error) or type(error).__name__
    if not isinstance(error, QuiesceError):
        text = f"{type(error).__name__}: {text}"
    at = f" at {judged.server}" if judged.server else ""
    return EnvironmentCheckpointError(
        f"environment checkpoint {operation} failed{at} ({judged.code}): {text}",
        operation=operation,
        code=judged.code,
        transient=bool(judged.transient),
        server=judged.server,
        secrets=secrets,
    )
