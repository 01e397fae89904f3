"""The event vocabulary: one payload model per kind, and the stored event record.

Writers are validated strictly (``extra="forbid"``; an unknown kind is refused by
``Ledger.append``). Readers never validate: ``Event.data`` is whatever was stored, so old
events stay readable when a payload model gains a field. New fields must be optional.

Column rules checked on append (``COLUMN_RULES``): ``attempt.*`` and ``phase.*`` events name
their ``checkpoint_id``; ``call.*`` events carry the ``call_id`` that pairs a ``call.sent``
with its outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict


class Payload(BaseModel):
    """Base of every payload model: unknown fields are refused on write."""

    model_config = ConfigDict(extra="forbid")


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

KINDS: Final = frozenset(PAYLOADS)

#: Which columns a kind requires on append: kind prefix -> column names.
COLUMN_RULES: Final[dict[str, tuple[str, ...]]] = {
    "attempt.": ("checkpoint_id",),
    "phase.": ("checkpoint_id",),
    "call.": ("call_id",),
}


@dataclass(frozen=True, slots=True)
class Event:
    """One stored row of ``events``. ``data`` is the stored payload (redacted, bodies capped).

    ``at`` is UTC ISO-8601 with microseconds and a ``Z`` suffix, e.g. ``2025-01-02T03:04:05.000006Z``.
    """

    seq: int
    at: str
    kind: str
    checkpoint_id: str | None
    server: str | None
    call_id: str | None
    epoch: int
    data: dict[str, Any]
    prev_hash: str
    hash: str


@dataclass(frozen=True, slots=True)
class AppendItem:
    """One event of an ``append_many`` batch; the arguments of ``append``."""

    kind: str
    checkpoint_id: str | None = None
    server: str | None = None
    call_id: str | None = None
    data: Any = field(default_factory=dict)
