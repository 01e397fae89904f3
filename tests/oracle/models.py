"""Strict models of the wire, as NeMo RL's anchor coordinator reads it — written from the team's
notes on NeMo Gym's control plane v1 (what running Gym's own code showed first), not from
`quiesce.coordinator.protocol`.

Every model forbids extra fields and spells every state as a literal, so a reference server that
drifts from the real wire (an extra field, a state RL does not know, a field missing) fails here.
Where real Gym and the anchor disagree the spec's **real Gym:** line wins, and the difference is
noted on the model: `checkpoint_mode` may be `restart_only` (Gym's own `control.py`); an in-flight
entry's `plane` may be null; a model restore returns `storage_reference_index` only when asked
(`include_storage_reference_index: true`, checked by the hook against the request) or, in later
Gym, always. Later Gym's agent also acknowledges a finished result only by its completion receipt
(`Receipt`): it shows it in each status entry of a held result and serves it on its own route;
RL's later coordinator sends the receipts, the anchor the bare pairs.

Deliberately independent of `quiesce.coordinator.protocol`: these are the test's own reading of the spec,
so a wrong field there cannot make itself right here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StringConstraints, model_validator

IDENTITY = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
Identity = Annotated[str, StringConstraints(min_length=1, pattern=IDENTITY)]
CheckpointId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=IDENTITY)]
Count = Annotated[int, Field(strict=True, ge=0)]
Positive = Annotated[int, Field(strict=True, ge=1)]
Seconds = Annotated[float, Field(ge=0)]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Admission = Literal["accepting", "draining", "paused"]
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


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- shared --------------------------------------------------------------------------------------


class Execution(Strict):
    rollout_id: Identity
    attempt_index: Count


class Receipt(Execution):
    """Later Gym's completion receipt of one held result."""

    execution_generation: Positive
    result_identity: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    result_digest: Sha256
    manifest_capture_key: Identity | None = None
    terminal_model_call_id: Annotated[str, StringConstraints(min_length=1)] | None = None

    @model_validator(mode="after")
    def _lineage(self) -> Receipt:
        if (self.manifest_capture_key is None) != (self.terminal_model_call_id is None):
            raise ValueError("manifest_capture_key and terminal_model_call_id go together")
        return self


class ArtifactReference(Strict):
    schema_version: Literal[1] = 1
    relative_path: Annotated[str, StringConstraints(min_length=1)]
    sha256: Sha256
    records: Count
    bytes: Count

    @model_validator(mode="after")
    def _relative(self) -> ArtifactReference:
        parts = self.relative_path.split("/")
        if self.relative_path.startswith("/") or ".." in parts or "" in parts:
            raise ValueError("relative_path must be a safe relative path")
        return self


class ControlRejection(Strict):
    class Body(Strict):
        code: Annotated[str, StringConstraints(min_length=1)]
        detail: str

    error: Body


# -- requests ------------------------------------------------------------------------------------


class ControlRequest(Strict):
    schema_version: Literal[1] = 1
    checkpoint_id: CheckpointId
    deadline_ts: FiniteFloat


class DirectoryRequest(ControlRequest):
    checkpoint_dir: Annotated[str, StringConstraints(min_length=1)]


class AgentDirectoryRequest(DirectoryRequest):
    include_continuation_index: bool = True


class ModelCommitRequest(DirectoryRequest):
    continuation_indexes: list[ArtifactReference]  # required, possibly empty


class ModelRestoreRequest(DirectoryRequest):
    include_storage_reference_index: bool = True


class AcknowledgeRequest(Strict):
    schema_version: Literal[1] = 1
    executions: Annotated[list[Execution] | list[Receipt], Field(min_length=1)]

    @model_validator(mode="after")
    def _unique(self) -> AcknowledgeRequest:
        keys = [(e.rollout_id, e.attempt_index) for e in self.executions]
        if len(keys) != len(set(keys)):
            raise ValueError("executions must be unique")
        return self


class DiscardRequest(ControlRequest):
    """Later Gym's `POST /agent-checkpoint/discard-restored-continuation`: the replacement
    execution whose restored continuation goes."""

    rollout_id: Identity
    attempt_index: Count


class ReceiptQuery(Strict):
    """Later Gym's `GET /agent-checkpoint/completion-receipt` (query values arrive as text)."""

    rollout_id: Identity
    attempt_index: Annotated[int, Field(ge=0)]


class ModelStatusQuery(Strict):
    checkpoint_id: CheckpointId
    deadline_ts: FiniteFloat | None = None
    wait_state: Literal["paused"] | None = None
    timeout_s: Seconds | None = None


class StatusQuery(Strict):
    checkpoint_id: CheckpointId
    deadline_ts: FiniteFloat | None = None


# -- replies: capabilities -----------------------------------------------------------------------


class MultiProcess(Strict):
    mode: Literal["single_worker", "coordinator", "unmanaged"]
    num_workers: Positive


class Capabilities(Strict):
    component: Literal["responses_api_models", "responses_api_agents", "resources_servers"]
    name: Annotated[str, StringConstraints(min_length=1)]
    schema_version: Literal[1]
    admission_states: list[Admission]
    # real Gym: `restart_only` exists in Gym's control.py (the anchor's model lacks it)
    checkpoint_mode: Literal["stateless", "export_restore", "restart_only"]
    concurrency_contract: Literal["stateless", "serialized_per_session", "transactional_parallel"]
    multi_process: MultiProcess
    instance_role: Literal["policy", "auxiliary"] | None = None
    phase: Phase
    active_checkpoint_id: str | None = None
    deadline_ts: FiniteFloat | None = None
    features: list[str] = Field(default_factory=list)


# -- replies: model ------------------------------------------------------------------------------


class WorkerAcknowledgements(Strict):
    acknowledged: Count
    expected: Count


class GenerationCounters(Strict):
    """Later Gym's counters beside `inflight_total`, all absent at the anchor; with a
    generation-cut backend `generation_cut_proof` is Gym's own opaque object."""

    response_inflight_total: Count | None = None
    generation_pending_total: Count | None = None
    generation_cut_proof: dict[str, object] | None = None


class ModelPauseReply(GenerationCounters):
    state: Admission
    workers: WorkerAcknowledgements
    inflight_total: Count
    waiters_total: Count


class InflightRequest(Strict):
    rollout_id: Identity | None = None
    attempt_index: Count | None = None
    plane: str | None  # real Gym: null without an x-nemo-gym-plane header
    age_seconds: Seconds


class SingleWorker(Strict):
    state: Admission
    inflight: Count


class SingleWorkerStatus(GenerationCounters):
    checkpoint_id: CheckpointId
    state: Admission
    per_worker: dict[str, SingleWorker]
    inflight_total: Count
    waiters_total: Count
    inflight: list[InflightRequest]
    tombstones: list[Execution]


class CoordinatorWorkers(Strict):
    acknowledged: Count
    expected: Positive
    live: Count


class CoordinatorWorker(Strict):
    acked_seq: Count
    inflight: Count
    connected: bool


class CoordinatorStatus(Strict):
    state: Admission
    workers: CoordinatorWorkers
    missing_workers: Count
    inflight_total: Count
    waiters_total: Count
    per_worker: dict[str, CoordinatorWorker]


class ModelCommitReply(Strict):
    rollouts: Count
    rows: Count
    excluded_tombstoned: Count
    excluded_inactive: Count = 0
    manifest_digest: Sha256
    storage_reference_index: ArtifactReference  # required by RL's strict model


class ModelRestoreReply(Strict):
    rollouts: Count
    rows: Count
    checkpoint_id: str | None = None
    tombstones: list[Execution]
    source_attempts: list[Execution]
    # present when asked (anchor) or always (later Gym): the hook checks it against the request
    storage_reference_index: ArtifactReference | None = None


class ModelResumeReply(Strict):
    state: Literal["accepting"]
    workers: WorkerAcknowledgements
    released_waiters: Count


# -- replies: agent ------------------------------------------------------------------------------


class AgentExecution(Strict):
    rollout_id: Identity
    attempt_index: Count
    generation: Positive
    state: Literal["running", "park_requested", "parked", "completed", "retired"]
    parked_boundary_state: Literal["parked_with_boundary", "parked_without_boundary"] | None
    boundary_index: Count | None = None
    completion_receipt: Receipt | None = None  # later Gym, on a held result
    age_seconds: Seconds


class AgentPrepareReply(Strict):
    state: Literal["accepting", "preparing"]
    ready_to_commit: bool
    running: Count
    parked: Count
    parked_with_boundary: Count
    parked_without_boundary: Count
    completed_unacknowledged: Count
    active: Count
    blocking_attempts: list[AgentExecution]
    completed_unacknowledged_attempts: list[AgentExecution]
    executions: list[AgentExecution]


class AgentStatusReply(AgentPrepareReply):
    """Gym's agent status: the prepare counters with the checkpoint id asked about."""

    checkpoint_id: CheckpointId


class AgentCommitReply(Strict):
    records: Count
    manifest_digest: Sha256
    continuation_index: ArtifactReference


class AgentRestoreReply(Strict):
    records: Count
    source_checkpoint_id: Annotated[str, StringConstraints(min_length=1)]
    continuation_index: ArtifactReference


class AgentResumeReply(Strict):
    state: Literal["accepting"]
    released: Count


class DiscardReply(Strict):
    discarded: bool


class AcknowledgeReply(Strict):
    acknowledged: list[Execution] | list[Receipt]

    @model_validator(mode="after")
    def _unique(self) -> AcknowledgeReply:
        keys = [(e.rollout_id, e.attempt_index) for e in self.acknowledged]
        if len(keys) != len(set(keys)):
            raise ValueError("acknowledged executions must be unique")
        return self


# -- replies: resources --------------------------------------------------------------------------


class ResourcesPrepareReply(Strict):
    sessions: Count
    state: Literal["prepared"]


class SessionStatus(Strict):
    rollout_id: Identity
    attempt_index: Count
    revision: Count
    locked: bool


class ResourcesStatusReply(Strict):
    checkpoint_id: CheckpointId
    state: Literal["accepting", "paused"]  # real Gym: the admission state, not the fence phase
    admission_state: Literal["accepting", "paused"]
    sessions: Count
    per_session: list[SessionStatus]


class ResourcesCommitReply(Strict):
    sessions: Count
    manifest_digest: Sha256


class ResourcesRestoreReply(Strict):
    sessions: Count
    source_checkpoint_id: Annotated[str, StringConstraints(min_length=1)]


class ResourcesResumeReply(Strict):
    state: Literal["accepting"]
