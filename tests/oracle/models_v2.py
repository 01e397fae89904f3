"""Strict models of Gym's unified checkpoint plane (v2, `/ng-control/v1/checkpoint/*`), written
from the team's notes on Gym's `_checkpoint/control.py` (what running Gym's code showed wins), not
from `quiesce.coordinator.protocol_v2`: they are the independent check, so a wrong field there
cannot make itself right here.

Rules kept:
- Every model forbids extra fields; every field Gym always sends is required (a reply is a
  `model_dump`, so nothing is left out), and a field never sent as null refuses null.
- An episode is an object `{rollout_id, attempt}` (never a capture-key string); a rollout id never
  ends in `-a<N>`; an attempt is an int ≥ 0.
- A status carries its kind's fields (environment `restored_pending`, agent `accepting`,
  resources `mode`/`verify`/`retired_sessions`, model `restored_generation_cuts`); a multi-worker
  server adds `workers`, `expected_workers`, `restored_pending`, `session_aliases` and
  `session_placements` (PW), all together. Idle means no checkpoint id and no lease.
- A model's commit reply adds `staging_keys` (sorted, unique) and `staging_keys_by_episode`; no
  other kind's does. Capture keys in replies are sorted where Gym sorts them.
- A refusal is `{"error": {"code", "detail"}}` with the status of `CODE_STATUS`; a body refused by
  validation is FastAPI's `{"detail": [{type, loc, msg, input, ...}]}`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

IDENTITY = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_ATTEMPT_SUFFIX = re.compile(r"-a[1-9][0-9]*$")
Identity = Annotated[str, StringConstraints(min_length=1, pattern=IDENTITY)]
CheckpointId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=IDENTITY)]
#: A capture key: a rollout id, or `<rollout_id>-a<N>`; both match the identity pattern.
CaptureKey = Identity
Count = Annotated[int, Field(strict=True, ge=0)]
Timestamp = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Phase = Literal["idle", "preparing", "prepared", "committed", "restored"]
Kind = Literal["environment", "model", "agent", "resources"]

#: Every refusal code and its HTTP status (the spec's table; `restart_in_scope` from its real-Gym
#: line; `checkpoint_coordinator_unavailable` from Gym's `_checkpoint/workers.py`).
CODE_STATUS: Final[dict[str, int]] = {
    "stale_checkpoint": 409,
    "checkpoint_conflict": 409,
    "invalid_phase": 409,
    "deadline_exceeded": 409,
    "stale_attempt": 409,
    "checkpoint_parked": 409,
    "admission_closed": 409,
    "rollout_id_required": 400,
    "unauthorized": 401,
    "invalid_checkpoint_state": 422,
    "checkpoint_error": 409,
    "restart_in_scope": 409,
    "checkpoint_coordinator_unavailable": 503,
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _sorted_unique(values: list[str], what: str) -> list[str]:
    if values != sorted(set(values)):
        raise ValueError(f"{what} must be sorted and unique")
    return values


# -- requests --------------------------------------------------------------------------------------


class EpisodeId(Strict):
    rollout_id: Identity
    attempt: Count = 0

    @field_validator("rollout_id")
    @classmethod
    def _no_attempt_suffix(cls, value: str) -> str:
        if _ATTEMPT_SUFFIX.search(value):
            raise ValueError("a rollout id must not end in -a<N>")
        return value


class CheckpointRequest(Strict):
    """prepare, renew, resume."""

    checkpoint_id: CheckpointId
    deadline_ts: Timestamp


class CommitRequest(CheckpointRequest):
    checkpoint_dir: Annotated[str, StringConstraints(min_length=1)]
    episode_ids: list[EpisodeId] | None = None
    stop: Annotated[bool, Field(strict=True)] = False


class RestoreRequest(CheckpointRequest):
    checkpoint_dir: Annotated[str, StringConstraints(min_length=1)]
    episode_ids: list[EpisodeId]


class RetireRequest(CheckpointRequest):
    episode_ids: Annotated[list[EpisodeId], Field(min_length=1)]


class ForgetRequest(CheckpointRequest):
    rollout_ids: Annotated[list[str], Field(min_length=1)]


# -- replies ---------------------------------------------------------------------------------------


class PrepareReport(Strict):
    ready: Annotated[bool, Field(strict=True)]
    blockers: Annotated[list[str], Field(max_length=100)]  # capture keys, or a worker's own blocker
    blocker_count: Count
    counts: dict[str, Count]
    restarts: list[CaptureKey]

    @model_validator(mode="after")
    def _counted(self) -> PrepareReport:
        if self.blocker_count < len(self.blockers):
            raise ValueError("blocker_count is less than the blockers listed")
        if self.ready and self.blocker_count:
            raise ValueError("ready with blockers")
        return self


class _Status(Strict):
    kind: Kind
    instance: Identity
    phase: Phase
    checkpoint_id: CheckpointId | None
    lease_expires_at: Timestamp | None
    retired_rollouts: Count
    report: PrepareReport
    # A multi-worker server's fields (PW), all or none.
    workers: Count | None = None
    expected_workers: Count | None = None
    session_aliases: Count | None = None
    session_placements: Count | None = None

    @model_validator(mode="after")
    def _consistent(self) -> _Status:
        if (self.phase == "idle") != (self.checkpoint_id is None):
            raise ValueError(f"phase {self.phase} with checkpoint_id {self.checkpoint_id!r}")
        if self.phase == "idle" and self.lease_expires_at is not None:
            raise ValueError("an idle participant holds no lease")
        worker_fields = (self.workers, self.expected_workers, self.session_aliases, self.session_placements)
        if any(v is not None for v in worker_fields) and any(v is None for v in worker_fields):
            raise ValueError("a multi-worker status carries all of its worker fields")
        return self

    @property
    def multi_worker(self) -> bool:
        return self.workers is not None


class EnvironmentStatus(_Status):
    kind: Literal["environment"]
    restored_pending: list[CaptureKey]


class AgentStatus(_Status):
    kind: Literal["agent"]
    accepting: Annotated[bool, Field(strict=True)]
    restored_pending: list[CaptureKey] | None = None  # multi-worker only


class ResourcesStatus(_Status):
    kind: Literal["resources"]
    mode: Literal["stateless", "exported", "restart_only"]
    verify: Literal["wait", "replay"]
    retired_sessions: Count
    restored_pending: list[CaptureKey] | None = None  # multi-worker only


class ModelStatus(_Status):
    kind: Literal["model"]
    restored_generation_cuts: list[CaptureKey]


STATUS_BY_KIND: Final[dict[str, type[_Status]]] = {
    "environment": EnvironmentStatus,
    "agent": AgentStatus,
    "resources": ResourcesStatus,
    "model": ModelStatus,
}


class PrepareReply(Strict):
    phase: Phase
    report: PrepareReport


class RenewReply(Strict):
    lease_expires_at: Timestamp


class Manifest(Strict):
    schema_version: Literal[1]
    kind: Kind
    instance: Identity
    checkpoint_id: CheckpointId
    records_file: Annotated[str, StringConstraints(pattern=r"^records-[0-9a-f]{64}\.jsonl$")]
    records_sha256: Sha256
    record_count: Count
    # A multi-worker server's extras (PW).
    session_owners: list[str] | None = None
    placed_sessions: list[str] | None = None

    @model_validator(mode="after")
    def _named_by_digest(self) -> Manifest:
        if self.records_file != f"records-{self.records_sha256}.jsonl":
            raise ValueError("records_file is not named by records_sha256")
        return self


class CommitReply(Strict):
    """Every kind but the model."""

    phase: Literal["committed"]
    manifest: Manifest
    episode_ids: list[CaptureKey]

    @field_validator("episode_ids")
    @classmethod
    def _sorted(cls, value: list[str]) -> list[str]:
        return _sorted_unique(value, "episode_ids")


class ModelCommitReply(CommitReply):
    staging_keys: list[str]
    staging_keys_by_episode: dict[CaptureKey, list[str]]

    @field_validator("staging_keys")
    @classmethod
    def _sorted_keys(cls, value: list[str]) -> list[str]:
        return _sorted_unique(value, "staging_keys")


class RestoreReply(Strict):
    phase: Literal["restored"]
    source_checkpoint_id: CheckpointId
    restored: list[CaptureKey]

    @field_validator("restored")
    @classmethod
    def _sorted(cls, value: list[str]) -> list[str]:
        if value != sorted(value):
            raise ValueError("restored must be sorted")
        return value


class ResumeReply(Strict):
    phase: Literal["idle"]
    idempotent: Annotated[bool, Field(strict=True)]


class RetireReply(Strict):
    retired: list[CaptureKey]


class ForgetReply(Strict):
    forgotten: list[str]

    @field_validator("forgotten")
    @classmethod
    def _sorted(cls, value: list[str]) -> list[str]:
        if value != sorted(value):  # real Gym: sorted(rollout_ids), duplicates kept
            raise ValueError("forgotten must be sorted")
        return value


# -- refusals --------------------------------------------------------------------------------------


class Refusal(Strict):
    class Error(Strict):
        code: Annotated[str, StringConstraints(min_length=1)]
        detail: str

    error: Error


class FastApiError(Strict):
    type: str
    loc: list[str | int]
    msg: str
    input: Any = None
    ctx: dict[str, Any] | None = None
    url: str | None = None


class ValidationRefusal(Strict):
    """FastAPI's 422 for a body that does not validate (before the bearer is checked)."""

    detail: Annotated[list[FastApiError], Field(min_length=1)]


REQUESTS: Final[dict[str, type[Strict]]] = {
    "prepare": CheckpointRequest,
    "renew": CheckpointRequest,
    "resume": CheckpointRequest,
    "commit": CommitRequest,
    "restore": RestoreRequest,
    "retire": RetireRequest,
    "forget": ForgetRequest,
}

#: The 200 reply of each route but status and commit (which depend on the kind).
REPLIES: Final[dict[str, type[Strict]]] = {
    "prepare": PrepareReply,
    "renew": RenewReply,
    "restore": RestoreReply,
    "resume": ResumeReply,
    "retire": RetireReply,
    "forget": ForgetReply,
}
