"""Wire models of NeMo Gym's checkpoint control plane v1 — both sides speak through these.

This is the only place the wire format is written down in code (it follows NeMo Gym's
`nemo_gym/_checkpoint/` package, schema version 1). The coordinator sends requests built from these models and
validates replies with them; the reference servers in `tools/gymsim` validate
requests and build replies with them.

Rules kept here:
- Request bodies forbid extra fields (a server answers 422); replies allow them
  (newer Gym adds fields) and keep them, so the coordinator can record them.
- `checkpoint_id` is 1-128 chars of `^[A-Za-z0-9][A-Za-z0-9._-]*$`; `deadline_ts`
  is a finite absolute Unix time; `schema_version` is 1 or omitted.
- Artifact references name files relative to the checkpoint dir: never absolute,
  never containing `..`.
- What real Gym sends is accepted (as running Gym's own control-plane code showed): an in-flight
  entry of a model status may name no rollout, attempt or plane (`plane: null` without an
  `x-nemo-gym-plane` header); a policy model behind Gym's multi-worker coordinator answers
  status with `workers`/`missing_workers`/`per_worker {acked_seq, inflight, connected}` and no
  `checkpoint_id`; `checkpoint_mode` may be `restart_only`.
- Later Gym's agent acknowledges a finished result only against its completion receipt
  (`CompletionReceipt`: read from `GET /agent-checkpoint/completion-receipt`, or, where the
  agent has no such route, from `completed_unacknowledged_attempts[].completion_receipt` of its
  status); the anchor's takes `{rollout_id, attempt_index}` and forbids anything more
  (`AcknowledgeBody` vs `ReceiptAcknowledgeBody`). A receipt goes back with exactly the fields
  the agent gave: agents differ in them and each forbids the ones it does not know, null or not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Annotated, Any, Final, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    field_validator,
    model_serializer,
    model_validator,
)

SCHEMA_VERSION: Final = 1
PREFIX: Final = "/ng-control/v1"

# ---------------------------------------------------------------------------------------------
# Names: components, phases, codes, headers
# ---------------------------------------------------------------------------------------------

Component = Literal["responses_api_models", "responses_api_agents", "resources_servers"]
MODEL: Final = "responses_api_models"
AGENT: Final = "responses_api_agents"
RESOURCES: Final = "resources_servers"

CheckpointMode = Literal["stateless", "export_restore", "restart_only"]
ConcurrencyContract = Literal["stateless", "serialized_per_session", "transactional_parallel"]
WorkerMode = Literal["single_worker", "coordinator", "unmanaged"]
InstanceRole = Literal["policy", "auxiliary"]
AdmissionState = Literal["accepting", "draining", "paused"]

Phase = Literal[
    "idle",
    "preparing",
    "prepared",
    "committing",
    "committed_paused",
    "restoring",
    "restore_failed_paused",
    "restored_paused",
]
PHASES: Final[tuple[Phase, ...]] = (
    "idle",
    "preparing",
    "prepared",
    "committing",
    "committed_paused",
    "restoring",
    "restore_failed_paused",
    "restored_paused",
)

Operation = Literal[
    "pause", "prepare", "status", "commit", "restore", "resume", "acknowledge", "receipt", "discard"
]

#: 401 body for a missing or wrong bearer token.
UNAUTHORIZED_DETAIL: Final = "missing or invalid control-plane bearer token"

# 409 error codes (`{"error": {"code", "detail"}}`).
STALE_CHECKPOINT: Final = "stale_checkpoint"
CHECKPOINT_CONFLICT: Final = "checkpoint_conflict"
INVALID_PHASE: Final = "invalid_phase"
NOT_A_POLICY_INSTANCE: Final = "not_a_policy_instance"
CHECKPOINT_PARKED: Final = "checkpoint_parked"
LEDGER_NOT_QUIESCENT: Final = "ledger_not_quiescent"
LEDGER_MISMATCH: Final = "ledger_mismatch"
AGENT_PREPARE_INCOMPLETE: Final = "agent_prepare_incomplete"
RESOURCES_ADMISSION_CLOSED: Final = "resources_admission_closed"
RESOURCES_CHECKPOINT_ERROR: Final = "resources_checkpoint_error"
UNSAFE_RESOURCES_RESTORE: Final = "unsafe_resources_restore"
MISSING_WORKERS: Final = "missing_workers"
COMPLETED_EXECUTION_ACKNOWLEDGEMENT_ERROR: Final = "completed_execution_acknowledgement_error"
#: An agent's `/run` for an execution a restore retired (or whose result was acknowledged).
STALE_ATTEMPT: Final = "stale_attempt"
#: An agent asked to discard the continuation of an execution that is already running.
DUPLICATE_EXECUTION: Final = "duplicate_execution"

# Capability features.
#: An agent that holds each finished rollout until `acknowledge-completed` releases it.
COMPLETED_RESULT_ACKNOWLEDGEMENT: Final = "completed_result_acknowledgement"
#: A policy model whose commit writes `storage-references.jsonl` and names it `storage_reference_index`.
EXTERNAL_STORAGE_REFERENCE_INDEX: Final = "external_storage_reference_index_v1"
AGENT_CONTINUATION_INDEX: Final = "agent_continuation_index_v1"
#: A later agent that drops a restored continuation on request (`discard-restored-continuation`),
#: allowed only while it is `restored_paused` under the restore's id.
DISCARD_RESTORED_CONTINUATION: Final = "discard_restored_continuation_v1"
#: A later agent whose continuation index rows name every resources server the continuation
#: depends on (`resource_state_revisions`, always a mapping, empty when it used none).
AGENT_RESOURCE_DEPENDENCY_INDEX: Final = "agent_resource_dependency_index_v1"

# Data-plane headers.
ROLLOUT_ID_HEADER: Final = "x-nemo-gym-rollout-id"
ATTEMPT_INDEX_HEADER: Final = "x-nemo-gym-attempt-index"
RESOURCE_REVISION_HEADER: Final = "x-nemo-gym-resource-state-revision"
#: Names the plane of a model call; real Gym reports `plane: null` for a call without it.
PLANE_HEADER: Final = "x-nemo-gym-plane"

#: Model data-plane paths gated by admission (a request path ending in one of these).
GATED_MODEL_PATH_SUFFIXES: Final = ("/v1/responses", "/v1/chat/completions", "/v1/messages")

TOKEN_ENV: Final = "NEMO_GYM_CHECKPOINT_CONTROL_TOKEN"
TOKEN_ENV_FALLBACK: Final = "NEMO_GYM_TOKEN_CAPTURE_CONTROL_TOKEN"

CHECKPOINT_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
CheckpointId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=CHECKPOINT_ID_PATTERN)]
#: Rollout ids travel in headers and file names: the checkpoint id's alphabet (Gym's ROLLOUT_ID_PATTERN).
RolloutId = Annotated[str, StringConstraints(min_length=1, pattern=CHECKPOINT_ID_PATTERN)]
Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
NonNegInt = Annotated[int, Field(ge=0)]


def capture_key(rollout_id: str, attempt_index: int) -> str:
    """The model ledger key of a rollout attempt: the rollout id, plus `-a<n>` for attempt n > 0."""
    return rollout_id if attempt_index == 0 else f"{rollout_id}-a{attempt_index}"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------
# File layout inside a checkpoint dir (relative paths, POSIX separators)
# ---------------------------------------------------------------------------------------------


def model_ledger_dir(name: str) -> str:
    return f"model-ledger/{name}"


#: In `model-ledger/<name>/`: one `<capture_key>.lineage.jsonl` per capture key, this index, the manifest.
LINEAGE_SUFFIX: Final = ".lineage.jsonl"
STORAGE_REFERENCES: Final = "storage-references.jsonl"


def agent_instance_dir(name: str) -> str:
    """`agent/instance-<sha256hex(name)>` — the agent's folder inside a checkpoint dir."""
    return f"agent/instance-{sha256_hex(name.encode('utf-8'))}"


#: In `agent/instance-<sha256hex(name)>/`, beside `continuations.jsonl` and `manifest.json`.
AGENT_CONTINUATIONS: Final = "continuations.jsonl"


def agent_record_file(rollout_id: str, attempt_index: int) -> str:
    """`<rollout_id>.a<attempt_index>.json` — one saved boundary record in an agent's folder."""
    return f"{rollout_id}.a{attempt_index}.json"


def resources_dir(name: str) -> str:
    return f"resources/{name}"


def manifest_path(component: str, name: str) -> str:
    """Where a participant's `manifest.json` lives, relative to the checkpoint dir."""
    if component == MODEL:
        return f"{model_ledger_dir(name)}/manifest.json"
    if component == AGENT:
        return f"{agent_instance_dir(name)}/manifest.json"
    if component == RESOURCES:
        return f"{resources_dir(name)}/manifest.json"
    raise ValueError(f"unknown component {component!r}")


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Reply(BaseModel):
    """Replies keep unknown fields (`model_extra`) so they can be recorded."""

    model_config = ConfigDict(extra="allow")


def _relative_path_ok(value: str) -> str:
    if not value or value.startswith("/") or "\\" in value:
        raise ValueError("relative_path must be a non-empty relative POSIX path")
    parts = PurePosixPath(value).parts
    if any(part in ("..", "") for part in parts) or PurePosixPath(value).is_absolute():
        raise ValueError("relative_path must not contain '..' or be absolute")
    return value


class ArtifactRef(BaseModel):
    """A file written by a server inside the checkpoint dir, with its digest, record and byte counts."""

    model_config = ConfigDict(extra="allow", frozen=True)

    schema_version: Literal[1] = 1
    relative_path: str
    sha256: Sha256Hex
    records: NonNegInt
    bytes: NonNegInt

    @field_validator("relative_path")
    @classmethod
    def _check_path(cls, value: str) -> str:
        return _relative_path_ok(value)


class Workers(_Reply):
    acknowledged: NonNegInt
    expected: NonNegInt


class ControlErrorBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    code: str
    detail: str | None = None
    message: str | None = None


class ControlError(BaseModel):
    """A 409 rejection: `{"error": {"code", "detail"}}` (resources data plane: `message`)."""

    model_config = ConfigDict(extra="allow")
    error: ControlErrorBody


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class CommonBody(_Request):
    """The common POST body: schema version, checkpoint id, absolute deadline."""

    schema_version: Literal[1] = 1
    checkpoint_id: CheckpointId
    deadline_ts: Annotated[float, Field(allow_inf_nan=False)]

    @field_validator("schema_version", mode="before")
    @classmethod
    def _exact_one(cls, value: Any) -> Any:
        # Reject `true`, `1.0`, "1": the spec says `1`.
        if type(value) is not int:
            raise ValueError("schema_version must be the integer 1")
        return value

    def budget_s(self, now: float) -> float:
        """Seconds left to the deadline; an expired deadline is 0 (no time to wait), not an error."""
        return max(0.0, self.deadline_ts - now)


class CheckpointDirBody(CommonBody):
    """Common body plus the folder the server writes to (commit) or reads from (restore)."""

    checkpoint_dir: Annotated[str, StringConstraints(min_length=1)]


class DiscardContinuationBody(CommonBody):
    """Drop the restored continuation of execution (`rollout_id`, `attempt_index`) — the
    replacement attempt n+1 a restore installed — so its `/run` starts from the task, not from
    the saved turn. `checkpoint_id` is the restore's."""

    rollout_id: RolloutId
    attempt_index: Annotated[int, Field(strict=True, ge=0)]


class ModelCommitBody(CheckpointDirBody):
    """Model commit: the agents' continuation indexes say how far each rollout got."""

    continuation_indexes: list[ArtifactRef] = Field(default_factory=list)


class ModelRestoreBody(CheckpointDirBody):
    """Model restore; `include_storage_reference_index: true` asks for the restored
    `storage_reference_index` (the anchor's opt-in, off when omitted; later Gym dropped the
    field — it always returns the index and refuses the field with 422)."""

    include_storage_reference_index: bool = False


#: The field later Gym refuses (422) on a model restore; the coordinator then sends `CheckpointDirBody`.
INCLUDE_STORAGE_REFERENCE_INDEX: Final = "include_storage_reference_index"


class ExecutionId(_Request):
    """One rollout execution: a rollout id and its attempt index."""

    rollout_id: RolloutId
    attempt_index: Annotated[int, Field(strict=True, ge=0)]


class CompletionReceipt(ExecutionId):
    """Later Gym: one retained finished result exactly as the agent reports it — what its
    acknowledgement must name (a stale or altered receipt releases nothing). The model-lineage
    pair (`manifest_capture_key`, `terminal_model_call_id`) is both set or both null.

    It serializes to exactly the fields it was built from: a field the agent did not give is
    never sent (agents without the model-lineage pair refuse it, even null, with 422
    `extra_forbidden`), and a field this model does not know is sent back unchanged."""

    model_config = ConfigDict(extra="allow", frozen=True)

    execution_generation: Annotated[int, Field(strict=True, ge=1)]
    result_identity: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    result_digest: Sha256Hex
    manifest_capture_key: RolloutId | None = None
    terminal_model_call_id: Annotated[str, StringConstraints(min_length=1)] | None = None

    @model_validator(mode="after")
    def _lineage_pair(self) -> CompletionReceipt:
        if (self.manifest_capture_key is None) != (self.terminal_model_call_id is None):
            raise ValueError("manifest_capture_key and terminal_model_call_id go together")
        return self

    @model_serializer(mode="wrap")
    def _as_given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        given = self.model_fields_set | set(self.model_extra or ())
        data: dict[str, Any] = handler(self)
        return {name: value for name, value in data.items() if name in given}


_E = TypeVar("_E", bound=ExecutionId)


def _unique_executions(value: list[_E]) -> list[_E]:
    keys = [(e.rollout_id, e.attempt_index) for e in value]
    if len(keys) != len(set(keys)):
        raise ValueError("executions must be unique")
    return value


class AcknowledgeBody(_Request):
    """`POST /agent-checkpoint/acknowledge-completed` (the anchor): results the caller now holds, as
    `{rollout_id, attempt_index}` pairs (at least one, no duplicates). Not fenced: it names no
    checkpoint id."""

    schema_version: Literal[1] = 1
    executions: Annotated[list[ExecutionId], Field(min_length=1)]

    _unique = field_validator("executions")(_unique_executions)


class ReceiptAcknowledgeBody(_Request):
    """The same request to later Gym's agent: each result named by its completion receipt."""

    schema_version: Literal[1] = 1
    executions: Annotated[list[CompletionReceipt], Field(min_length=1)]

    _unique = field_validator("executions")(_unique_executions)


class ReceiptQuery(BaseModel):
    """Query of later Gym's `GET /agent-checkpoint/completion-receipt`: one execution."""

    model_config = ConfigDict(extra="forbid")
    rollout_id: RolloutId
    attempt_index: Annotated[int, Field(ge=0)]


class StatusQuery(BaseModel):
    """Query of the status GETs. The model's long-poll also takes `wait_state` and `timeout_s`."""

    model_config = ConfigDict(extra="ignore")
    checkpoint_id: CheckpointId
    deadline_ts: Annotated[float, Field(allow_inf_nan=False)] | None = None
    wait_state: Literal["paused"] | None = None
    timeout_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None


# ---------------------------------------------------------------------------------------------
# Replies
# ---------------------------------------------------------------------------------------------


class MultiProcess(_Reply):
    mode: WorkerMode
    num_workers: Annotated[int, Field(ge=1)] = 1


class Capabilities(_Reply):
    """`GET /capabilities`: what the server is, and its fence state (phase, active id, deadline)."""

    component: Component
    name: str
    schema_version: int
    admission_states: list[str] = Field(default_factory=list)
    checkpoint_mode: CheckpointMode
    concurrency_contract: ConcurrencyContract = "stateless"
    multi_process: MultiProcess = Field(default_factory=lambda: MultiProcess(mode="single_worker"))
    instance_role: InstanceRole | None = None
    features: list[str] = Field(default_factory=list)
    phase: Phase = "idle"
    active_checkpoint_id: str | None = None
    deadline_ts: float | None = None


# Model server -------------------------------------------------------------------------------


class _GenerationCut(_Reply):
    """Later Gym's admission counters beside `inflight_total` (pause and status replies). With a
    generation-cut backend a pause cuts the calls in flight at once: `paused` with
    `generation_pending_total` 0 and a `generation_cut_proof`, while their responses stay held
    until resume — so `inflight_total` does not fall to 0 before then. Without one (and at the
    anchor, which sends none of these) `paused` means drained."""

    inflight_total: NonNegInt
    response_inflight_total: NonNegInt | None = None
    generation_pending_total: NonNegInt | None = None
    generation_cut_proof: dict[str, Any] | None = None

    def held_by_cut(self) -> bool:
        """Whether calls are in flight only because a generation cut holds their responses until
        resume: they will not drain while the model is paused."""
        return (
            self.generation_cut_proof is not None
            and self.generation_pending_total == 0
            and self.inflight_total > 0
        )


class ModelPauseReply(_GenerationCut):
    state: Literal["draining", "paused"]
    workers: Workers
    waiters_total: NonNegInt = 0


class WorkerStatus(_Reply):
    """One worker of a model status: `state` (single worker), or `acked_seq`/`connected`
    (a worker behind Gym's multi-worker coordinator, which reports no per-worker state)."""

    state: AdmissionState | None = None
    inflight: NonNegInt = 0
    acked_seq: NonNegInt | None = None
    connected: bool | None = None


class InflightEntry(_Reply):
    """A model call in flight. Every identity field may be null (real Gym: a call without
    rollout headers names no rollout, one without `x-nemo-gym-plane` has `plane: null`)."""

    rollout_id: str | None = None
    attempt_index: int | None = None
    plane: str | None = None
    age_seconds: float | None = None


class CoordinatorWorkers(_Reply):
    """`workers` of a multi-worker (coordinator mode) status: acknowledged, expected, live."""

    acknowledged: NonNegInt
    expected: NonNegInt
    live: NonNegInt


class ModelStatusReply(_GenerationCut):
    """The status long-poll. Single worker: names its `checkpoint_id`, per-worker `state`.
    Coordinator mode: no `checkpoint_id`; `workers`, `missing_workers`, per-worker `acked_seq`."""

    checkpoint_id: str | None = None
    state: AdmissionState
    per_worker: dict[str, WorkerStatus] = Field(default_factory=dict)
    waiters_total: NonNegInt = 0
    inflight: list[InflightEntry] = Field(default_factory=list)
    tombstones: list[Any] = Field(default_factory=list)
    workers: CoordinatorWorkers | None = None
    missing_workers: NonNegInt | None = None

    @property
    def coordinator_mode(self) -> bool:
        """True for the multi-worker coordinator's shape (it reports `workers`)."""
        return self.workers is not None

    def not_drained(self, pause_workers: Workers | None = None) -> str | None:
        """Why this reply does not show a drained model (None when it does), read from the reply
        itself: `paused`, nothing in flight, and every worker there and acknowledged — coordinator
        mode: no missing worker and acknowledged = expected; single worker: each per-worker state
        `paused`, and the pause reply's workers acknowledged (or each expected worker reporting)."""
        problems: list[str] = []
        if self.state != "paused":
            problems.append(f"state {self.state}")
        if self.inflight_total:
            problems.append(f"{self.inflight_total} requests still in flight")
        if self.workers is not None:
            if self.missing_workers:
                problems.append(f"{self.missing_workers} of {self.workers.expected} workers missing")
            if self.workers.acknowledged != self.workers.expected:
                problems.append(
                    f"{self.workers.acknowledged} of {self.workers.expected} workers acknowledged"
                )
        else:
            unpaused = sorted(k for k, w in self.per_worker.items() if w.state not in (None, "paused"))
            if unpaused and self.state == "paused":
                problems.append(f"workers {', '.join(unpaused)} not paused")
            if pause_workers is not None and pause_workers.acknowledged < pause_workers.expected:
                reporting = sum(1 for w in self.per_worker.values() if w.state == "paused")
                if reporting < pause_workers.expected:
                    problems.append(
                        f"{pause_workers.acknowledged} of {pause_workers.expected} workers acknowledged"
                    )
        return "; ".join(problems) or None


class ModelCommitReply(_Reply):
    rollouts: NonNegInt
    rows: NonNegInt
    excluded_tombstoned: NonNegInt = 0
    excluded_inactive: NonNegInt = 0
    manifest_digest: Sha256Hex
    storage_reference_index: ArtifactRef | None = None


class ModelRestoreReply(_Reply):
    """`checkpoint_id` is the restored (source) id, or null; `storage_reference_index` comes back
    when asked (`include_storage_reference_index`, the anchor) or always (later Gym)."""

    rollouts: NonNegInt
    rows: NonNegInt
    checkpoint_id: str | None = None
    tombstones: list[Any] | int = Field(default_factory=list)
    source_attempts: list[Any] | dict[str, Any] | int = Field(default_factory=list)
    storage_reference_index: ArtifactRef | None = None


class ModelResumeReply(_Reply):
    state: Literal["accepting"]
    workers: Workers | None = None
    released_waiters: NonNegInt = 0


# Agent server -------------------------------------------------------------------------------


class AgentCounters(_Reply):
    """Counters of `prepare` and `status`."""

    state: str
    ready_to_commit: bool = False
    running: NonNegInt = 0
    parked: NonNegInt = 0
    parked_with_boundary: NonNegInt = 0
    parked_without_boundary: NonNegInt = 0
    completed_unacknowledged: NonNegInt = 0
    active: NonNegInt = 0
    blocking_attempts: list[Any] = Field(default_factory=list)
    completed_unacknowledged_attempts: list[Any] = Field(default_factory=list)
    executions: list[Any] = Field(default_factory=list)


class AgentPrepareReply(AgentCounters):
    ready_to_commit: bool = True


class AgentStatusReply(AgentCounters):
    pass


class AgentCommitReply(_Reply):
    records: NonNegInt
    manifest_digest: Sha256Hex
    continuation_index: ArtifactRef


class AgentRestoreReply(_Reply):
    records: NonNegInt
    source_checkpoint_id: str
    continuation_index: ArtifactRef


class DiscardContinuationReply(_Reply):
    """`discarded`: whether a restored continuation was there to drop (false: none was installed
    for that execution — its `/run` starts from the task all the same)."""

    discarded: Annotated[bool, Field(strict=True)]


class AcknowledgedExecution(_Reply):
    rollout_id: str
    attempt_index: NonNegInt


class AcknowledgeReply(_Reply):
    """Every requested execution the agent now considers acknowledged (exactly the requested set;
    later Gym answers each with its receipt)."""

    acknowledged: list[AcknowledgedExecution]


class CompletionReceiptReply(_Reply):
    """Later Gym's completion receipt of one held result (`GET /agent-checkpoint/completion-receipt`)."""

    rollout_id: RolloutId
    attempt_index: NonNegInt
    execution_generation: Annotated[int, Field(strict=True, ge=1)]
    result_identity: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    result_digest: Sha256Hex
    manifest_capture_key: RolloutId | None = None
    terminal_model_call_id: Annotated[str, StringConstraints(min_length=1)] | None = None

    def receipt(self) -> CompletionReceipt:
        """The receipt to acknowledge with: exactly the fields the agent gave, as it gave them."""
        return CompletionReceipt.model_validate(self.model_dump(exclude_unset=True))


class AgentResumeReply(_Reply):
    state: Literal["accepting"]
    released: NonNegInt = 0


class ContinuationRow(BaseModel):
    """One line of `continuations.jsonl` (compact JSON, rows sorted by capture key)."""

    model_config = ConfigDict(extra="allow")

    schema_version: Literal[1] = 1
    rollout_id: str
    attempt_index: NonNegInt
    capture_key: str
    last_committed_model_call_id: str | None
    #: null in indexes Gym wrote before its dependency-aware recovery
    resource_state_revisions: dict[str, int] | None = Field(default_factory=dict)


class AgentManifest(BaseModel):
    """An agent's `manifest.json` as Gym writes it, last, in `agent/instance-<sha256hex(name)>/`.

    `files` maps each boundary record's file name (`agent_record_file`, in the same folder) to its
    sha256; `continuation_index` names `continuations.jsonl`, whose rows are only the records
    that have a `last_committed_model_call_id`.
    """

    model_config = ConfigDict(extra="allow")

    schema_version: Literal[1] = 1
    checkpoint_id: str
    instance_name: str | None = None
    files: dict[str, Sha256Hex]
    continuation_index: ArtifactRef


class AgentRecordIdentity(BaseModel):
    """The identity every saved agent boundary record carries (the rest of it is the agent's):
    a restore retires `(rollout_id, attempt_index)` and continues it as `attempt_index + 1`."""

    model_config = ConfigDict(extra="allow")

    rollout_id: RolloutId
    attempt_index: Annotated[int, Field(strict=True, ge=0)]


class StorageReference(BaseModel):
    """One line of a model's `storage-references.jsonl`: an external token-storage row a committed
    continuation needs (compact JSON, rows sorted by `key`, keys unique)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    capture_key: RolloutId
    boundary_model_call_id: Annotated[str, StringConstraints(min_length=1)]
    kind: Literal["token_capture_staging"] = "token_capture_staging"
    key: Annotated[str, StringConstraints(min_length=1)]


# Resources server ---------------------------------------------------------------------------


class ResourcesPrepareReply(_Reply):
    sessions: NonNegInt
    state: Literal["prepared"]


class SessionStatus(_Reply):
    rollout_id: str
    attempt_index: int
    revision: NonNegInt
    locked: bool


class ResourcesStatusReply(_Reply):
    checkpoint_id: str | None
    state: str
    admission_state: str
    sessions: NonNegInt
    per_session: list[SessionStatus] = Field(default_factory=list)


class ResourcesCommitReply(_Reply):
    sessions: NonNegInt
    manifest_digest: Sha256Hex


class ResourcesRestoreReply(_Reply):
    sessions: NonNegInt
    source_checkpoint_id: str


class ResourcesResumeReply(_Reply):
    state: Literal["accepting"]


# ---------------------------------------------------------------------------------------------
# The route table: (component, operation) -> method, path, request model, reply model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """One control route of one component. `request` is None for GETs (query from `StatusQuery`)."""

    component: str
    operation: Operation
    method: Literal["GET", "POST"]
    path: str
    request: type[_Request] | None
    reply: type[_Reply]

    @property
    def full_path(self) -> str:
        return PREFIX + self.path


CAPABILITIES_PATH: Final = PREFIX + "/capabilities"

_ROUTE_LIST: Final[tuple[Route, ...]] = (
    Route(MODEL, "pause", "POST", "/model-admission/pause", CommonBody, ModelPauseReply),
    Route(MODEL, "status", "GET", "/model-admission/status", None, ModelStatusReply),
    Route(MODEL, "commit", "POST", "/model-checkpoint/commit", ModelCommitBody, ModelCommitReply),
    Route(MODEL, "restore", "POST", "/model-checkpoint/restore", ModelRestoreBody, ModelRestoreReply),
    Route(MODEL, "resume", "POST", "/model-admission/resume", CommonBody, ModelResumeReply),
    Route(AGENT, "prepare", "POST", "/agent-checkpoint/prepare", CommonBody, AgentPrepareReply),
    Route(AGENT, "status", "GET", "/agent-checkpoint/status", None, AgentStatusReply),
    Route(AGENT, "commit", "POST", "/agent-checkpoint/commit", CheckpointDirBody, AgentCommitReply),
    Route(AGENT, "restore", "POST", "/agent-checkpoint/restore", CheckpointDirBody, AgentRestoreReply),
    Route(AGENT, "resume", "POST", "/agent-checkpoint/resume", CommonBody, AgentResumeReply),
    Route(
        AGENT,
        "acknowledge",
        "POST",
        "/agent-checkpoint/acknowledge-completed",
        AcknowledgeBody,
        AcknowledgeReply,
    ),
    Route(
        AGENT,
        "receipt",
        "GET",
        "/agent-checkpoint/completion-receipt",
        None,
        CompletionReceiptReply,
    ),
    Route(
        AGENT,
        "discard",
        "POST",
        "/agent-checkpoint/discard-restored-continuation",
        DiscardContinuationBody,
        DiscardContinuationReply,
    ),
    Route(RESOURCES, "prepare", "POST", "/resources-checkpoint/prepare", CommonBody, ResourcesPrepareReply),
    Route(RESOURCES, "status", "GET", "/resources-checkpoint/status", None, ResourcesStatusReply),
    Route(
        RESOURCES, "commit", "POST", "/resources-checkpoint/commit", CheckpointDirBody, ResourcesCommitReply
    ),
    Route(
        RESOURCES,
        "restore",
        "POST",
        "/resources-checkpoint/restore",
        CheckpointDirBody,
        ResourcesRestoreReply,
    ),
    Route(RESOURCES, "resume", "POST", "/resources-checkpoint/resume", CommonBody, ResourcesResumeReply),
)

ROUTES: Final[Mapping[tuple[str, str], Route]] = {(r.component, r.operation): r for r in _ROUTE_LIST}


def route(component: str, operation: str) -> Route:
    """The route of `operation` on `component`; KeyError if the component has no such operation."""
    return ROUTES[(component, operation)]


#: 409 codes the fence answers before it runs anything (Gym's `ControlFence`: a retired id,
#: another id active, a phase the operation is not allowed in).
_REFUSED_CODES: Final = frozenset(
    {STALE_CHECKPOINT, CHECKPOINT_CONFLICT, INVALID_PHASE, NOT_A_POLICY_INSTANCE}
)


def refused_before_effect(status: int | None, code: str | None) -> bool:
    """Whether a reply refused a control request before it ran: a missing or wrong token (401), a
    body that does not validate (422), or the fence's own refusals — a retired id, another id
    active, a phase not allowed. The server is as it was: the request paused nothing."""
    return status in (401, 422) or (status == 409 and code in _REFUSED_CODES)
