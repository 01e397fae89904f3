"""API v1's request and reply bodies (pydantic; FastAPI builds the OpenAPI schema from them).

They mirror the embedded API: an `AttemptModel` carries what `coordinator.Attempt` carries, an
`OutcomeModel` what `coordinator.Outcome` does, a `HistoryRow` what `ledger.AttemptRow` does, so
the client (`quiesce.tools.serve.client`) rebuilds the very objects `Coordinator` returns. Requests
forbid unknown fields (a typo is a 422, not a silently ignored option). Every error reply is
`ErrorReply` (`{"error": {...}}`), a request that does not validate too (`fields` lists why).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from quiesce.coordinator.attempt import Attempt, Outcome, Resubmission, UnknownResubmissions
from quiesce.coordinator.discovery import Discovery, Member
from quiesce.coordinator.protocol import AcknowledgeBody
from quiesce.coordinator.protocol_v2 import EpisodeId
from quiesce.coordinator.retire import RetireOutcome
from quiesce.coordinator.snapshots import SnapshotInfo
from quiesce.coordinator.status import ClusterStatus, Holder, ServerStatus
from quiesce.ledger import AttemptRow
from quiesce.ledger.lineage import STATES, LineageViolation, Rollout, Step, StepKind


class Request(BaseModel):
    """Every request body: unknown fields refused, and NaN or an infinity in a number field too
    (JSON decoders accept `NaN` and `Infinity`; no deadline or count is one)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# -- errors -----------------------------------------------------------------------------------


class FieldProblem(BaseModel):
    """One reason a request did not validate (`InvalidRequest`, HTTP 422)."""

    field: str = Field(description="where, e.g. `body.deadline_s` or `body.executions[0][1]`")
    problem: str = Field(description="what, e.g. `must be more than 0`")


class ErrorBody(BaseModel):
    """What went wrong. `type` is the error class (`PhaseError`, `Busy`, `Unavailable`, ...)."""

    type: str
    message: str
    checkpoint_id: str | None = None
    operation: str | None = None
    phase: str | None = None
    server: str | None = None
    reason: str | None = None
    code: str | None = None
    resumed: list[str] | None = None
    not_resumed: list[str] | None = None
    latest_snapshot: str | None = None
    warnings: list[str] | None = Field(
        default=None,
        description="`PhaseError` of a restore: the warnings given before it began, e.g. that the ledger"
        " did not publish the snapshot (its manifest could not be checked against a recorded digest)",
    )
    differences: list[str] | None = None
    reasons: list[tuple[str, str]] | None = None
    state: str | None = None
    active: str | None = Field(default=None, description="a standby names the active service's address")
    held: dict[str, str] | None = Field(
        default=None, description="`ServersHeld`: each held server → the checkpoint id holding it"
    )
    status: int | None = Field(
        default=None, description="`AcknowledgementError`: the HTTP status of the agent's reply"
    )
    fields: list[FieldProblem] | None = Field(
        default=None, description="`InvalidRequest` (422): each field that did not validate, and why"
    )


class ErrorReply(BaseModel):
    error: ErrorBody


# -- discovery --------------------------------------------------------------------------------


class MemberModel(BaseModel):
    name: str
    component: str
    checkpoint_mode: str
    instance_role: str | None
    role: str
    url: str
    plane: Literal["v1", "v2"] = Field(
        default="v1",
        description="the control plane it speaks: `v2` is Gym's unified plane (`component` its kind)",
    )

    @classmethod
    def of(cls, member: Member) -> MemberModel:
        return cls(
            name=member.name,
            component=member.component,
            checkpoint_mode=member.checkpoint_mode,
            instance_role=member.instance_role,
            role=member.role,
            url=member.url,
            plane=member.plane,
        )

    def member(self) -> Member:
        return Member(
            name=self.name,
            component=self.component,
            checkpoint_mode=self.checkpoint_mode,
            instance_role=self.instance_role,
            role=self.role,  # type: ignore[arg-type]  # a Role the service sent
            url=self.url,
            plane=self.plane,
        )


class NamedReason(BaseModel):
    name: str
    reason: str


class DiscoveryModel(BaseModel):
    participants: list[MemberModel]
    skipped: list[NamedReason]
    refused: list[NamedReason]
    warnings: list[str]

    @classmethod
    def of(cls, found: Discovery) -> DiscoveryModel:
        return cls(
            participants=[MemberModel.of(m) for m in found.participants],
            skipped=[NamedReason(name=n, reason=r) for n, r in found.skipped],
            refused=[NamedReason(name=n, reason=r) for n, r in found.refused],
            warnings=list(found.warnings),
        )

    def discovery(self) -> Discovery:
        return Discovery(
            participants=tuple(m.member() for m in self.participants),
            skipped=tuple((s.name, s.reason) for s in self.skipped),
            refused=tuple((s.name, s.reason) for s in self.refused),
            warnings=tuple(self.warnings),
        )


# -- attempts ---------------------------------------------------------------------------------


class SaveRequest(Request):
    """A save (`POST /v1/attempts`, and the whole save of `CheckpointRequest`)."""

    deadline_s: float | None = Field(
        default=None, gt=0, description="budget of the attempt (default: config)"
    )
    episodes: list[EpisodeId] | None = Field(
        default=None,
        description="Gym's unified plane only: the episodes the trainer continues (the commit scope),"
        " `[{rollout_id, attempt}]`; default: what the environment servers export",
    )
    into: str | None = Field(
        default=None,
        min_length=1,
        description="Gym's unified plane only: a folder on the service's host to commit into and publish"
        " in place (the trainer's own snapshot folder), instead of the snapshots folder",
    )


class CheckpointRequest(SaveRequest):
    """`POST /v1/checkpoints`: a whole save."""

    stop: bool = Field(
        default=False,
        description="Gym's unified plane only: a stop-checkpoint — published, then the servers stay paused"
        " for shutdown (restore into freshly started servers to go on)",
    )


class ResubmissionModel(BaseModel):
    """One execution a restore continues but does not run (`coordinator.Resubmission`): send agent
    `server`'s `/run` for `rollout_id` as `attempt_index` (the saved attempt + 1) once resumed."""

    server: str
    rollout_id: str
    attempt_index: int

    @classmethod
    def of(cls, resubmission: Resubmission) -> ResubmissionModel:
        return cls(**dataclasses.asdict(resubmission))

    def resubmission(self) -> Resubmission:
        return Resubmission(self.server, self.rollout_id, self.attempt_index)


class UnknownResubmissionsModel(BaseModel):
    """An agent whose saved folder does not say which executions a restore continues
    (`coordinator.UnknownResubmissions`): its state was restored; `reason` says why not."""

    server: str
    reason: str

    @classmethod
    def of(cls, unknown: UnknownResubmissions) -> UnknownResubmissionsModel:
        return cls(server=unknown.server, reason=unknown.reason)

    def unknown(self) -> UnknownResubmissions:
        return UnknownResubmissions(self.server, self.reason)


class AttemptModel(BaseModel):
    """One attempt as `coordinator.Attempt` holds it; `outcome` once it ended."""

    checkpoint_id: str
    kind: Literal["save", "restore"]
    state: str
    deadline_ts: float
    participants: list[MemberModel]
    staging_dir: str | None = None
    snapshot: str | None = None
    source_checkpoint_id: str | None = None
    touched: list[str] = []
    outcome: str | None = None
    resubmit: list[ResubmissionModel] = Field(
        default=[],
        description="a successful restore: every execution to send `/run` for again once the servers"
        " resume (Gym's restore runs none of them by itself), in order; empty otherwise. On the unified"
        " plane: the replacement attempts the trainer starts once resumed",
    )
    restart: list[ResubmissionModel] = Field(
        default=[],
        description="a successful v1 restore: executions whose saved turn was discarded (it depended on"
        " a `restart_only` resources server): send their `/run` once resumed, it starts from the task",
    )
    resubmit_unknown: list[UnknownResubmissionsModel] = Field(
        default=[],
        description="a successful v1 restore: agents whose saved folder does not say which executions to"
        " send again (their state was restored), each with the reason",
    )
    warnings: list[str] = Field(
        default=[], description="warnings given before the attempt began (preflight, provenance)"
    )
    plane: Literal["v1", "v2"] = Field(default="v1", description="the control plane of its servers")
    scope: list[str] = Field(
        default=[], description="unified plane: the episodes the commit (or restore) covered, capture keys"
    )
    restarts: dict[str, list[str]] = Field(
        default={},
        description="unified plane: per server, the episodes it cannot capture (left out of the scope;"
        " the trainer starts them over)",
    )
    exported: dict[str, list[str]] = Field(
        default={}, description="unified plane: per server, the episodes its commit exported"
    )
    restored: dict[str, list[str]] = Field(
        default={}, description="unified plane: per server, the next attempts its restore installed"
    )
    stop: bool = Field(
        default=False, description="unified plane: a stop-checkpoint (its servers stay paused for shutdown)"
    )

    @classmethod
    def of(cls, attempt: Attempt, outcome: str | None = None) -> AttemptModel:
        return cls(
            checkpoint_id=attempt.checkpoint_id,
            kind=attempt.kind,
            state=attempt.state,
            deadline_ts=attempt.deadline_ts,
            participants=[MemberModel.of(m) for m in attempt.participants],
            staging_dir=str(attempt.staging_dir) if attempt.staging_dir is not None else None,
            snapshot=str(attempt.snapshot) if attempt.snapshot is not None else None,
            source_checkpoint_id=attempt.source_checkpoint_id,
            touched=list(attempt.touched),
            outcome=outcome,
            resubmit=[ResubmissionModel.of(r) for r in attempt.resubmit],
            restart=[ResubmissionModel.of(r) for r in attempt.restart],
            resubmit_unknown=[UnknownResubmissionsModel.of(u) for u in attempt.resubmit_unknown],
            warnings=list(attempt.warnings),
            plane=attempt.plane,
            scope=list(attempt.scope),
            restarts={server: list(keys) for server, keys in attempt.restarts.items()},
            exported={server: list(keys) for server, keys in attempt.exported.items()},
            restored={server: list(keys) for server, keys in attempt.restored.items()},
            stop=attempt.stop,
        )

    def attempt(self) -> Attempt:
        return Attempt(
            checkpoint_id=self.checkpoint_id,
            kind=self.kind,
            deadline_ts=self.deadline_ts,
            participants=tuple(m.member() for m in self.participants),
            staging_dir=Path(self.staging_dir) if self.staging_dir is not None else None,
            snapshot=Path(self.snapshot) if self.snapshot is not None else None,
            source_checkpoint_id=self.source_checkpoint_id,
            state=self.state,  # type: ignore[arg-type]  # an AttemptState the service sent
            touched=list(self.touched),
            resubmit=tuple(r.resubmission() for r in self.resubmit),
            restart=tuple(r.resubmission() for r in self.restart),
            resubmit_unknown=tuple(u.unknown() for u in self.resubmit_unknown),
            warnings=list(self.warnings),
            scope=tuple(self.scope),
            restarts={server: tuple(keys) for server, keys in self.restarts.items()},
            exported={server: tuple(keys) for server, keys in self.exported.items()},
            restored={server: tuple(keys) for server, keys in self.restored.items()},
            stop=self.stop,
        )


class PublishRequest(Request):
    resume: bool = Field(
        default=False, description="resume every server once published (what leaving `save()` does)"
    )


class AbortRequest(Request):
    reason: str = Field(default="aborted by request", max_length=500)
    checkpoint_id: str | None = Field(
        default=None,
        description="the attempt to roll back (default: the one waiting here, else whatever holds the"
        " servers, asked now)",
    )


class ResumeRequest(Request):
    checkpoint_id: str | None = Field(
        default=None,
        description="the checkpoint id to let go of (default: whatever holds the servers, asked now)",
    )


class RestoreRequest(Request):
    snapshot: str | None = Field(
        default=None,
        description="a snapshot folder, a checkpoint id under `snapshots`, or `latest` (default)",
    )
    deadline_s: float | None = Field(default=None, gt=0)
    resume: bool = Field(default=False, description="resume every server once restored")


class OutcomeModel(BaseModel):
    """What a resume, abort or restore's resume did (`coordinator.Outcome`); `also`: what was done
    for the other checkpoint ids that held the servers, in order."""

    checkpoint_id: str | None
    outcome: str
    servers: list[str] = []
    resumed: list[str] = []
    not_paused: list[str] = []
    left_paused: list[str] = []
    also: list[OutcomeModel] = []
    resubmit: list[ResubmissionModel] = Field(
        default=[], description="the resume of a restore: every execution to send `/run` for again"
    )
    restored_again: list[str] = Field(
        default=[],
        description="the resume of a restore: servers restarted since it, restored again before the resume",
    )
    restart: list[ResubmissionModel] = Field(
        default=[], description="the resume of a v1 restore: executions whose saved turn was discarded"
    )
    resubmit_unknown: list[UnknownResubmissionsModel] = Field(
        default=[], description="the resume of a v1 restore: agents whose resubmissions are unknown, and why"
    )

    @classmethod
    def of(cls, outcome: Outcome) -> OutcomeModel:
        return cls(
            checkpoint_id=outcome.checkpoint_id,
            outcome=outcome.outcome,
            servers=list(outcome.servers),
            resumed=list(outcome.resumed),
            not_paused=list(outcome.not_paused),
            left_paused=list(outcome.left_paused),
            also=[cls.of(o) for o in outcome.also],
            resubmit=[ResubmissionModel.of(r) for r in outcome.resubmit],
            restored_again=list(outcome.restored_again),
            restart=[ResubmissionModel.of(r) for r in outcome.restart],
            resubmit_unknown=[UnknownResubmissionsModel.of(u) for u in outcome.resubmit_unknown],
        )

    def outcome_(self) -> Outcome:
        return Outcome(
            self.checkpoint_id,
            self.outcome,
            tuple(self.servers),
            tuple(self.resumed),
            tuple(self.not_paused),
            tuple(self.left_paused),
            tuple(o.outcome_() for o in self.also),
            tuple(r.resubmission() for r in self.resubmit),
            tuple(self.restored_again),
            restart=tuple(r.resubmission() for r in self.restart),
            resubmit_unknown=tuple(u.unknown() for u in self.resubmit_unknown),
        )


class RestoreReply(BaseModel):
    attempt: AttemptModel
    resumed: OutcomeModel | None = None


# -- completed results ------------------------------------------------------------------------


class AcknowledgeRequest(Request):
    """`POST /v1/acknowledge`: agent `server` may release these finished results, which the caller
    now holds. `executions` must be what Gym accepts (at least one, no duplicate, valid ids): a
    body that is not is a 422 before anything is sent."""

    server: str = Field(min_length=1, description="an agent server of the config")
    executions: list[tuple[str, int]] = Field(
        min_length=1, description="`[[rollout_id, attempt_index], ...]`"
    )

    @field_validator("executions")
    @classmethod
    def _as_gym_accepts(cls, value: list[tuple[str, int]]) -> list[tuple[str, int]]:
        try:
            AcknowledgeBody.model_validate(
                {"executions": [{"rollout_id": r, "attempt_index": a} for r, a in value]}
            )
        except ValidationError as error:
            first = error.errors()[0]
            loc = [str(p) for p in first["loc"][1:]]  # drop "executions"
            where = f"executions[{loc[0]}]" + "".join(f".{p}" for p in loc[1:]) if loc else "executions"
            raise ValueError(f"{where}: {first['msg']}") from None
        return value


class AcknowledgeReply(BaseModel):
    server: str
    acknowledged: list[tuple[str, int]]


# -- retire and forget (Gym's unified plane) ----------------------------------------------------


class RetireRequest(Request):
    """`POST /v1/retire`: stop these attempts on every server, and refuse them until forgotten."""

    episodes: list[EpisodeId] = Field(
        min_length=1, description="the attempts to retire, `[{rollout_id, attempt}]` (attempt default 0)"
    )
    deadline_s: float | None = Field(default=None, gt=0, description="budget (default: config)")


class ForgetRequest(Request):
    """`POST /v1/forget`: drop the retire marks of these rollouts on every server."""

    rollout_ids: list[str] = Field(min_length=1, description="rollout ids, as Gym accepts them")
    deadline_s: float | None = Field(default=None, gt=0, description="budget (default: config)")

    @field_validator("rollout_ids")
    @classmethod
    def _as_gym_accepts(cls, value: list[str]) -> list[str]:
        for i, rollout_id in enumerate(value):
            try:
                EpisodeId(rollout_id=rollout_id)
            except ValidationError as error:
                raise ValueError(f"rollout_ids[{i}]: {error.errors()[0]['msg']}") from None
        return value


class RetireReply(BaseModel):
    """What a retire or forget did (`coordinator.RetireOutcome`); a server that failed it makes the
    request fail instead (502 `PhaseError` naming it)."""

    operation: Literal["retire", "forget"]
    checkpoint_id: str = Field(description="the id the requests carried")
    items: list[str] = Field(description="retire: capture keys; forget: rollout ids (deduplicated, sorted)")
    servers: list[str] = Field(description="the servers called, in order (callers first)")
    failed: dict[str, str] = {}

    @classmethod
    def of(cls, outcome: RetireOutcome) -> RetireReply:
        return cls.model_validate(outcome.as_json())

    def outcome(self) -> RetireOutcome:
        return RetireOutcome(
            self.operation, self.checkpoint_id, tuple(self.items), tuple(self.servers), dict(self.failed)
        )


# -- status -----------------------------------------------------------------------------------


class HolderModel(BaseModel):
    """A checkpoint id that holds servers (`quiesce.coordinator.status.Holder`); `verb` is the embedded
    method that frees it (`resume` or `abort`), `frees` the command line."""

    checkpoint_id: str
    kind: Literal["save", "restore", "unknown"]
    state: str
    started_at: str | None
    finished: bool
    frees: str
    verb: Literal["resume", "abort"]

    @classmethod
    def of(cls, holder: Holder) -> HolderModel:
        return cls(**holder.as_json(), verb=holder.verb)

    def holder(self) -> Holder:
        return Holder(
            self.checkpoint_id, self.kind, self.state, self.started_at, self.verb, self.frees, self.finished
        )


_UNIFIED_STATUS_FIELDS = ("kind", "lease_expires_at", "blocker_count")


class ServerStatusModel(BaseModel):
    """One server's fence and what holds it (`quiesce.coordinator.status.ServerStatus.as_json`)."""

    name: str
    url: str
    reachable: bool
    phase: str | None
    active_checkpoint_id: str | None
    held: bool
    held_by: str | None
    holder_kind: str | None
    since: str | None
    deadline_left_s: float | None
    frees: str | None
    error: str | None
    plane: Literal["v1", "v2"] = "v1"
    kind: str | None = Field(default=None, description="unified plane: the server's kind")
    lease_expires_at: float | None = Field(
        default=None, description="unified plane: when its lease runs out (Unix seconds; null: none held)"
    )
    blocker_count: int | None = Field(
        default=None, description="unified plane: what its prepare still waits for"
    )


class StatusModel(BaseModel):
    """`GET /v1/status`: what `quiesce status --json` prints, each holder with its `verb` too.

    `status()` rebuilds the `quiesce.coordinator.status.ClusterStatus` `Coordinator.status()` returns, but
    for each server's `capabilities` (not sent: None); `deadline_left_s` is as of the service's read.
    """

    idle: bool
    held: bool
    servers: list[ServerStatusModel]
    holders: list[HolderModel]
    unfinished: list[str]

    @classmethod
    def of(cls, status: ClusterStatus) -> StatusModel:
        document = status.as_json()
        document["holders"] = [HolderModel.of(h) for h in status.holders]
        return cls.model_validate(document)

    def document(self) -> dict[str, Any]:
        """The reply's JSON: `kind`, `lease_expires_at` and `blocker_count` only for a unified-plane
        server — the document `ClusterStatus.as_json` (`quiesce status --json`) gives."""
        document = self.model_dump(mode="json")
        for server in document["servers"]:
            if server["plane"] != "v2":
                for name in _UNIFIED_STATUS_FIELDS:
                    del server[name]
        return document

    def status(self) -> ClusterStatus:
        holders = {h.checkpoint_id: h.holder() for h in self.holders}
        return ClusterStatus(
            tuple(
                ServerStatus(
                    s.name,
                    s.url,
                    s.reachable,
                    phase=s.phase,
                    active_checkpoint_id=s.active_checkpoint_id,
                    held_by=s.held_by,
                    since=s.since,
                    deadline_left_s=s.deadline_left_s,
                    holder=holders.get(s.held_by) if s.held_by is not None else None,
                    error=s.error,
                    plane=s.plane,
                    kind=s.kind,
                    lease_expires_at=s.lease_expires_at,
                    blocker_count=s.blocker_count,
                )
                for s in self.servers
            ),
            tuple(self.unfinished),
        )


# -- snapshots --------------------------------------------------------------------------------


class SnapshotModel(BaseModel):
    """One published snapshot (`quiesce.coordinator.snapshots.SnapshotInfo`): what `quiesce snapshots
    --json` lists."""

    id: str = Field(description="its folder's name; `POST /v1/restore` takes it as `snapshot`")
    path: str
    created: str | None
    size: int = Field(description="bytes: every file its manifest lists, and the manifest")
    files: int
    participants: list[str]
    latest: bool = Field(description="the one `LATEST` names (what a restore of `latest` restores)")

    @classmethod
    def of(cls, info: SnapshotInfo) -> SnapshotModel:
        return cls.model_validate(info.as_json())

    def info(self) -> SnapshotInfo:
        return SnapshotInfo(
            id=self.id,
            path=Path(self.path),
            created=self.created,
            size=self.size,
            files=self.files,
            participants=tuple(self.participants),
            latest=self.latest,
        )


# -- reading ----------------------------------------------------------------------------------


class HistoryRow(BaseModel):
    """One row of the `attempts` projection (`ledger.AttemptRow`)."""

    checkpoint_id: str
    kind: str
    state: str
    outcome: str | None
    started_at: str
    ended_at: str | None
    deadline_ts: float | None
    participants: list[str]
    epoch: int
    calls: int
    failures: int
    recovered_by: int | None
    last_seq: int

    @classmethod
    def of(cls, row: AttemptRow) -> HistoryRow:
        fields = {f.name: getattr(row, f.name) for f in dataclasses.fields(row)}
        return cls(**{**fields, "participants": list(row.participants)})

    def row(self) -> AttemptRow:
        return AttemptRow(**{**self.model_dump(), "participants": tuple(self.participants)})


# -- rollout lineage --------------------------------------------------------------------------

RolloutState = Literal["live", "restarted", "retired", "finished", "lost"]
assert get_args(RolloutState) == STATES  # the lineage's states, as the query and reply name them


class StepModel(BaseModel):
    """One step of a rollout's lineage (`quiesce.ledger.lineage.Step`)."""

    seq: int
    what: StepKind
    attempt: int | None = Field(description="the rollout attempt it concerns; null: the whole rollout")
    checkpoint_id: str | None
    servers: list[str]
    detail: str | None

    def step(self) -> Step:
        return Step(self.seq, self.what, self.attempt, self.checkpoint_id, tuple(self.servers), self.detail)


class RolloutModel(BaseModel):
    """One rollout: its newest attempt, its state now, its steps (`quiesce.ledger.lineage.Rollout`)."""

    rollout_id: str
    attempt: int
    state: RolloutState
    steps: list[StepModel]

    def rollout(self) -> Rollout:
        return Rollout(self.rollout_id, self.attempt, self.state, [s.step() for s in self.steps])


class LineageViolationModel(BaseModel):
    """A broken lineage rule (or a warning), at the seq of the event that shows it."""

    seq: int
    rule: Literal["lost", "twice", "retired", "inventory", "expect"]
    checkpoint_id: str | None
    rollout_id: str
    message: str

    def violation(self) -> LineageViolation:
        return LineageViolation(self.seq, self.rule, self.checkpoint_id, self.rollout_id, self.message)


class RolloutsReply(BaseModel):
    """`GET /v1/rollouts`: what `quiesce rollouts --json` prints."""

    rollouts: list[RolloutModel]
    counts: dict[str, int] = Field(description="rollouts in each state, over the whole ledger (zeros too)")
    violations: list[LineageViolationModel] = Field(description="of the rollouts shown")
    warnings: list[LineageViolationModel] = Field(description="of the rollouts shown")
    unknown: list[str] | None = Field(
        default=None, description="the rollout ids asked for that the ledger never recorded (only when some)"
    )


class Readiness(BaseModel):
    """`/readyz` and `/healthz`: the service's state; ready = lease held, recovery done, ledger writable."""

    state: str
    ready: bool
    epoch: int | None = None
    active: str | None = None
    busy: str | None = None
    recovery: dict[str, Any] | None = None
