"""The payload models: one pydantic model per event kind, and validation of a payload to append.

Only writers need them (``Ledger.append`` validates against them); they are loaded on a ledger's
first append, so opening a ledger to read builds none of them. ``ledger.events`` re-exports every
name. ``PAYLOADS`` covers exactly ``ledger.events.KINDS`` (checked by the tests).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ledger.errors import LedgerError

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
    "NamedReason",
    "Participant",
    "Payload",
    "PhaseCompleted",
    "PhaseFailed",
    "PhaseStarted",
    "RecoveryCompleted",
    "RecoverySettled",
    "RecoveryStarted",
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


class PhaseStarted(Payload):
    phase: str


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
}


def _format_validation(kind: str, error: ValidationError) -> str:
    # Never include the input: it may hold a secret the redactor has not seen yet.
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(payload)'}: {e['msg']}"
        for e in error.errors(include_input=False, include_url=False)
    )
    return f"invalid {kind} payload: {problems}"


def validate_payload(kind: str, data: Any) -> Any:
    """``data`` (a mapping or a pydantic model) validated against the model of ``kind`` (one of
    ``PAYLOADS``), as JSON-ready data; ``LedgerError`` when it does not fit."""
    model = PAYLOADS[kind]
    try:
        if isinstance(data, model):
            return data.model_dump(mode="json")
        if isinstance(data, BaseModel):
            return model.model_validate(data.model_dump(mode="json")).model_dump(mode="json")
        if isinstance(data, Mapping):
            return model.model_validate(data).model_dump(mode="json")
        raise LedgerError(
            f"a {kind} payload must be a mapping or a {model.__name__}, not {type(data).__name__}"
        )
    except ValidationError as error:
        raise LedgerError(_format_validation(kind, error)) from None
