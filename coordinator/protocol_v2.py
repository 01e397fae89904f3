"""Wire models of NeMo Gym's unified checkpoint control plane ("v2", `/ng-control/v1/checkpoint/*`).

Both sides speak through these: the coordinator builds every v2 request from them and validates
every reply with them; the reference servers (`tools/gymsim/v2`) validate requests and build
replies with them. Written from Gym's `nemo_gym/_checkpoint/control.py`, `store.py` and
`episode_types.py`; v1's models live in `protocol.py`.

Rules kept here:
- One route set for every participant kind (`environment`, `model`, `agent`, `resources`), all
  bearer-protected, all under `PREFIX`; requests forbid unknown fields (so a v1-shaped body with
  `schema_version` is refused, as Gym refuses it); replies allow and keep them.
- `checkpoint_id` is 1–128 chars of `^[A-Za-z0-9][A-Za-z0-9._-]*$`; `deadline_ts` is a finite
  absolute Unix time.
- An episode is `{rollout_id, attempt}`; its capture key is the rollout id for attempt 0 and
  `<rollout_id>-a<attempt>` otherwise, so a rollout id may never end in `-a<N>` (N ≥ 1) and a
  capture key always inverts to exactly one episode.
- A participant's state lives in `<checkpoint_dir>/gym/<kind>/<instance>/`: one
  `records-<sha256>.jsonl` (one JSON object per line, the sha256 over the exact bytes) and a
  `manifest.json` (sorted keys, indent 1) that is created once, last.
- A refusal is `{"error": {"code", "detail"}}` with the status of `CODE_STATUS`; a body that does
  not validate gets FastAPI's 422 `{"detail": [...]}` before the bearer is checked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

PREFIX: Final = "/ng-control/v1/checkpoint"
STATUS_PATH: Final = PREFIX + "/status"

Kind = Literal["environment", "model", "agent", "resources"]
#: Gym's stage order: prepare runs stage by stage in this order; resume runs it backwards.
STAGES: Final[tuple[Kind, ...]] = ("environment", "model", "agent", "resources")
KINDS: Final = frozenset(STAGES)

V2Phase = Literal["idle", "preparing", "prepared", "committed", "restored"]
V2_PHASES: Final[tuple[V2Phase, ...]] = ("idle", "preparing", "prepared", "committed", "restored")

# Error codes (`{"error": {"code", "detail"}}`) and their HTTP status.
STALE_CHECKPOINT: Final = "stale_checkpoint"
CHECKPOINT_CONFLICT: Final = "checkpoint_conflict"
INVALID_PHASE: Final = "invalid_phase"
DEADLINE_EXCEEDED: Final = "deadline_exceeded"
STALE_ATTEMPT: Final = "stale_attempt"
CHECKPOINT_PARKED: Final = "checkpoint_parked"
ADMISSION_CLOSED: Final = "admission_closed"
ROLLOUT_ID_REQUIRED: Final = "rollout_id_required"
UNAUTHORIZED: Final = "unauthorized"
INVALID_CHECKPOINT_STATE: Final = "invalid_checkpoint_state"
CHECKPOINT_ERROR: Final = "checkpoint_error"
#: real Gym: a commit scope naming an episode the participant reports under `restarts`.
RESTART_IN_SCOPE: Final = "restart_in_scope"

CODE_STATUS: Final[Mapping[str, int]] = {
    STALE_CHECKPOINT: 409,
    CHECKPOINT_CONFLICT: 409,
    INVALID_PHASE: 409,
    DEADLINE_EXCEEDED: 409,
    STALE_ATTEMPT: 409,
    CHECKPOINT_PARKED: 409,
    ADMISSION_CLOSED: 409,
    ROLLOUT_ID_REQUIRED: 400,
    UNAUTHORIZED: 401,
    INVALID_CHECKPOINT_STATE: 422,
    CHECKPOINT_ERROR: 409,
    RESTART_IN_SCOPE: 409,
}

#: The most blockers a prepare report lists (`blocker_count` has the full count).
MAX_BLOCKERS: Final = 100
#: How many resumed checkpoint ids a participant remembers (each is answered `stale_checkpoint`).
RESUMED_IDS_KEPT: Final = 64
#: Gym's default lease grace (`checkpoint.lease_grace_seconds`).
DEFAULT_LEASE_GRACE_S: Final = 600.0

# Data-plane headers of the v2 episode protocol.
VERIFY_HEADER: Final = "x-ng-checkpoint-verify"
RESTART_HEADER: Final = "x-ng-checkpoint-restart"

ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
CheckpointId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=ID_PATTERN)]
SafeName = Annotated[str, StringConstraints(min_length=1, pattern=ID_PATTERN)]
_ATTEMPT_SUFFIX: Final = re.compile(r"-a([1-9][0-9]*)$")
_ID_RE: Final = re.compile(ID_PATTERN)
Deadline = Annotated[float, Field(allow_inf_nan=False)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Reply(BaseModel):
    """Replies keep unknown fields (`model_extra`): newer Gym adds fields; they are recorded."""

    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------------------------------------
# Episodes
# ---------------------------------------------------------------------------------------------


class EpisodeId(BaseModel):
    """One attempt of one rollout (Gym's `EpisodeId`): frozen, hashable, no extra fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rollout_id: SafeName
    attempt: Annotated[int, Field(ge=0, strict=True)] = 0

    @field_validator("rollout_id")
    @classmethod
    def _no_attempt_suffix(cls, value: str) -> str:
        if _ATTEMPT_SUFFIX.search(value):
            raise ValueError("rollout_id must not end in -a<N> (that suffix names an attempt)")
        return value

    @property
    def capture_key(self) -> str:
        return capture_key_of(self.rollout_id, self.attempt)

    def next_attempt(self) -> EpisodeId:
        return EpisodeId(rollout_id=self.rollout_id, attempt=self.attempt + 1)


def capture_key_of(rollout_id: str, attempt: int) -> str:
    """The rollout id for attempt 0, `<rollout_id>-a<attempt>` otherwise."""
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


def episode_of_key(key: str) -> EpisodeId:
    """The episode a capture key names (the inverse of `capture_key`); ValueError if it names none."""
    match = _ATTEMPT_SUFFIX.search(key)
    if match is None:
        return EpisodeId(rollout_id=key, attempt=0)
    return EpisodeId(rollout_id=key[: match.start()], attempt=int(match.group(1)))


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class CheckpointRequest(_Request):
    """The body of prepare, renew and resume: the checkpoint id and the absolute deadline."""

    checkpoint_id: CheckpointId
    deadline_ts: Deadline


class CommitRequest(CheckpointRequest):
    """Commit into `checkpoint_dir`, exporting the episodes of `episode_ids` (null: every one the
    participant holds, except its restarts; a model requires a scope). `stop` parks what was
    exported for shutdown (the participant stays paused)."""

    checkpoint_dir: Annotated[str, StringConstraints(min_length=1)]
    episode_ids: list[EpisodeId] | None = None
    stop: bool = False


class RestoreRequest(CheckpointRequest):
    """Restore (with a *new* id) the episodes of `episode_ids` from `checkpoint_dir`."""

    checkpoint_dir: Annotated[str, StringConstraints(min_length=1)]
    episode_ids: list[EpisodeId]


class RetireRequest(CheckpointRequest):
    """Stop these attempts (and every earlier attempt of their rollouts) and refuse them until forget."""

    episode_ids: Annotated[list[EpisodeId], Field(min_length=1)]


class ForgetRequest(CheckpointRequest):
    """Drop the retire marks of these rollouts."""

    rollout_ids: Annotated[list[SafeName], Field(min_length=1)]


# ---------------------------------------------------------------------------------------------
# Replies
# ---------------------------------------------------------------------------------------------


class PrepareReport(_Reply):
    """Readiness: `blockers` lists at most `MAX_BLOCKERS` capture keys (`blocker_count` counts them
    all); `restarts` (never capped) are in-flight episodes the participant cannot capture — they
    never block, and a commit scope must leave them out."""

    ready: bool
    blockers: list[str] = Field(default_factory=list)
    blocker_count: Annotated[int, Field(ge=0)] = 0
    counts: dict[str, int] = Field(default_factory=dict)
    restarts: list[str] = Field(default_factory=list)


class StatusReply(_Reply):
    """`GET /status`: what the participant is and where it stands (plus per-kind fields)."""

    kind: Kind
    instance: SafeName
    phase: V2Phase
    checkpoint_id: str | None = None
    lease_expires_at: float | None = None
    retired_rollouts: Annotated[int, Field(ge=0)] = 0
    report: PrepareReport


class PrepareReply(_Reply):
    """`prepared` when ready; `preparing` when the deadline came first (call prepare again with the
    same id); any other phase when a resume or lease expiry intervened."""

    phase: V2Phase
    report: PrepareReport


class RenewReply(_Reply):
    lease_expires_at: float


class ParticipantManifest(_Reply):
    """A participant's `manifest.json` (schema 1), as written on disk and echoed by commit."""

    schema_version: Literal[1]
    kind: Kind
    instance: SafeName
    checkpoint_id: CheckpointId
    records_file: str
    records_sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    record_count: Annotated[int, Field(ge=0)]


class CommitReply(_Reply):
    """`episode_ids` are the capture keys exported, sorted. A model adds `staging_keys` (sorted,
    unique) and `staging_keys_by_episode` (capture key → keys)."""

    phase: Literal["committed"]
    manifest: ParticipantManifest
    episode_ids: list[str]
    staging_keys: list[str] | None = None
    staging_keys_by_episode: dict[str, list[str]] | None = None


class RestoreReply(_Reply):
    """`restored` lists the next-attempt capture keys of the records found in the scope, sorted."""

    phase: Literal["restored"]
    source_checkpoint_id: CheckpointId
    restored: list[str]


class ResumeReply(_Reply):
    phase: Literal["idle"]
    idempotent: bool = False


class RetireReply(_Reply):
    retired: list[str]


class ForgetReply(_Reply):
    forgotten: list[str]


# ---------------------------------------------------------------------------------------------
# Records (one JSON object per line of a records file)
# ---------------------------------------------------------------------------------------------


class EnvironmentRecord(_Reply):
    episode_id: EpisodeId
    task_digest: str
    boundary: Any = None


class AgentSessionRecord(_Reply):
    episode_id: EpisodeId
    session_key: str
    session: Any = None


class ResourcesSessionRecord(_Reply):
    episode_id: EpisodeId
    session_id: str
    state: Any = None


class GenerationCut(_Reply):
    model_call_id: str
    request_digest: str
    continuation: Any = None


class ModelRecord(_Reply):
    episode_id: EpisodeId
    rows: list[Any]
    generation_cuts: list[GenerationCut] = Field(default_factory=list)


RECORD_MODELS: Final[Mapping[str, type[BaseModel]]] = {
    "environment": EnvironmentRecord,
    "agent": AgentSessionRecord,
    "resources": ResourcesSessionRecord,
    "model": ModelRecord,
}


# ---------------------------------------------------------------------------------------------
# Storage layout
# ---------------------------------------------------------------------------------------------

MANIFEST: Final = "manifest.json"
RECORDS_PATTERN: Final = re.compile(r"^records-[0-9a-f]{64}\.jsonl$")
#: The older fixed name a reader still accepts.
LEGACY_RECORDS: Final = "records.jsonl"


def participant_dir(kind: str, instance: str) -> str:
    """`gym/<kind>/<instance>`, relative to the checkpoint dir; ValueError for an unsafe name."""
    for part in (kind, instance):
        if not _ID_RE.match(part):
            raise ValueError(f"{part!r} is not a safe path component")
    return f"gym/{kind}/{instance}"


def records_file_name(sha256_hex: str) -> str:
    return f"records-{sha256_hex}.jsonl"


def record_line(record: Mapping[str, Any]) -> bytes:
    """One line of a records file: `json.dumps` default form, key order kept, then `\\n`."""
    return (json.dumps(record) + "\n").encode("utf-8")


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    """A manifest's bytes on disk: sorted keys, indent 1."""
    return json.dumps(manifest, sort_keys=True, indent=1).encode("utf-8")


# ---------------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------------

Operation = Literal["status", "prepare", "renew", "commit", "restore", "resume", "retire", "forget"]


@dataclass(frozen=True)
class V2Route:
    """One route of the unified plane (the same for every kind). `request` is None for the GET."""

    operation: Operation
    method: Literal["GET", "POST"]
    request: type[CheckpointRequest] | None
    reply: type[_Reply]

    @property
    def full_path(self) -> str:
        return f"{PREFIX}/{self.operation}"


ROUTES: Final[Mapping[str, V2Route]] = {
    r.operation: r
    for r in (
        V2Route("status", "GET", None, StatusReply),
        V2Route("prepare", "POST", CheckpointRequest, PrepareReply),
        V2Route("renew", "POST", CheckpointRequest, RenewReply),
        V2Route("commit", "POST", CommitRequest, CommitReply),
        V2Route("restore", "POST", RestoreRequest, RestoreReply),
        V2Route("resume", "POST", CheckpointRequest, ResumeReply),
        V2Route("retire", "POST", RetireRequest, RetireReply),
        V2Route("forget", "POST", ForgetRequest, ForgetReply),
    )
}


def stage_of(kind: str) -> int:
    """The prepare stage of a kind (0 = first)."""
    return STAGES.index(kind)


#: 409 codes a participant answers before the operation did anything.
_REFUSED_CODES: Final = frozenset({STALE_CHECKPOINT, CHECKPOINT_CONFLICT, INVALID_PHASE})


def refused_before_effect(status: int | None, code: str | None) -> bool:
    """Whether a reply refused a request before it ran: a bad token (401), a body FastAPI would not
    validate (422 without an error code), a 500 to a body Gym could not even render (a non-finite
    deadline), or the phase machine's own refusals."""
    if status in (401, 500):
        return True
    if status == 422:
        return code is None
    return status == 409 and code in _REFUSED_CODES


def unique_episodes(episodes: Iterable[EpisodeId]) -> list[EpisodeId]:
    """`episodes` without repeats, sorted by capture key (the order a scope is sent and recorded in)."""
    return sorted(set(episodes), key=lambda e: (e.rollout_id, e.attempt))
