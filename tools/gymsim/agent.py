"""Reference agent server, spec §4, and the rollouts it runs.

`POST /run {rollout_id, turns, attempt_index?}` (attempt 0 unless given) starts a rollout that
loops turn by turn:

    boundary → model call (policy model, rollout headers) → tool call (resources,
    one mutation) → the turn is applied: digest, turn log, model call id, revision

A turn changes the rollout only at its very end, in one step, so a rollout is
always exactly at a boundary or inside one turn. Its final result is a pure
function of its id and the exact turns it ran (each turn's model output depends on
the previous digest, each tool result on the session's whole mutation history), so
a turn lost or run twice changes the result; the turn log records which attempt
ran which turn, with the model call id and resource revision it saw.

Checkpoint rules (export_restore agents):
- a finished rollout is held as `completed_unacknowledged` until its consumer acknowledges it
  (`POST /agent-checkpoint/acknowledge-completed`, feature `completed_result_acknowledgement`):
  the whole batch is checked first — every execution must be held or already acknowledged,
  else 409 `completed_execution_acknowledgement_error` and nothing is released — then each is
  released (a repeated acknowledgement answers the same). Its view stays in `/rollouts`
  (`acknowledged: true`); it is never part of a checkpoint. With a receipt `acknowledgement`
  (later Gym) an acknowledgement must name each result by its completion receipt, exactly in
  that version's fields: a bare `{rollout_id, attempt_index}` is a 422, and so is a field the
  version does not have (`receipt_status`, `receipt_plain`: generation, result identity and
  digest; `receipt` adds the model-lineage pair, null or not); a receipt that is not the held
  result's is a 409 and nothing is released. Every status entry of a held result shows its
  receipt (`completion_receipt`); `receipt_plain` and `receipt` also serve it at
  `GET /agent-checkpoint/completion-receipt`, `receipt_status` has no such route (404).
- prepare closes admission (`/run` answers 409 `checkpoint_parked`) and asks every
  rollout to park at its next boundary; it waits within the budget until none is
  running. It is ready (`ready_to_commit`) only with nothing running, no parked rollout
  without a boundary and no unacknowledged completion; otherwise 409
  `agent_prepare_incomplete` with those three counts (the fence goes back to idle, the
  park request stays until resume). A rollout whose model call was refused with
  `checkpoint_parked` has changed nothing of its turn: it is parked at its last boundary
  (`parked_with_boundary`) and re-runs the turn from there. The prepare reply has exactly the
  anchor's fields, `state` `preparing` once a checkpoint asked the rollouts to park.
- commit writes, under `agent/instance-<sha256hex(instance name)>/`, as real Gym does: one
  `<rollout_id>.a<attempt_index>.json` per parked rollout (its boundary record, which names
  `rollout_id` and `attempt_index`), `continuations.jsonl` (the spec's rows, sorted by capture
  key, only for records with a `last_committed_model_call_id`) and `manifest.json` last
  (`schema_version`, `checkpoint_id`, `instance_name`, `files`: record file name → sha256,
  `continuation_index`); durable before it answers.
- restore verifies every digest (each record against `files`, the index against its reference
  and against the records) and that `instance_name` is this agent's, then, for each record of
  execution (rollout, n): retires (rollout, n) — a later `/run` of it answers 409
  `stale_attempt` — and installs the record as the continuation of (rollout, n+1) without
  starting it (its view: status `restored`, waiting for its `/run`). The agent stays closed
  until resume.
- resume reopens admission and releases every rollout parked in this process (`released`
  counts those); a restored continuation is not one: nothing runs it until the trainer sends
  `/run` for (rollout, n+1), which continues from the saved boundary (turns, digest, turn log,
  model call id, revisions: the record's; the record's `turns`, whatever the body says) and ends
  with the result the uninterrupted rollout gets. `/run` of any other attempt of a rollout id this
  agent holds answers 409 `rollout_exists`. A restored continuation is not an execution: prepare
  and status do not count it and a checkpoint taken before its `/run` does not save it (as Gym).
- with `discard` (later Gym) the agent declares `discard_restored_continuation_v1` and
  `agent_resource_dependency_index_v1` and serves `POST /agent-checkpoint/discard-restored-continuation
  {checkpoint_id, deadline_ts, rollout_id, attempt_index}` — only while `restored_paused` under that
  id (else the fence's 409) — which drops the restored continuation of (rollout, attempt_index) and
  answers `{"discarded": true}` (`false` when none was installed; 409 `duplicate_execution` once
  it runs): its `/run` then starts from the task, as a fresh rollout.

A `stateless` (or `restart_only`) agent serves `/run` the same way but never parks, holds no
result and commits nothing (empty index): the coordinator skips it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
from fastapi import HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator
from starlette.responses import JSONResponse

from quiesce.coordinator.protocol import (
    AGENT,
    AGENT_CONTINUATIONS,
    AGENT_PREPARE_INCOMPLETE,
    AGENT_RESOURCE_DEPENDENCY_INDEX,
    ATTEMPT_INDEX_HEADER,
    CHECKPOINT_ID_PATTERN,
    CHECKPOINT_PARKED,
    COMPLETED_EXECUTION_ACKNOWLEDGEMENT_ERROR,
    COMPLETED_RESULT_ACKNOWLEDGEMENT,
    DISCARD_RESTORED_CONTINUATION,
    DUPLICATE_EXECUTION,
    RESOURCE_REVISION_HEADER,
    RESOURCES_ADMISSION_CLOSED,
    ROLLOUT_ID_HEADER,
    STALE_ATTEMPT,
    AcknowledgeBody,
    AcknowledgeReply,
    AgentCommitReply,
    AgentManifest,
    AgentPrepareReply,
    AgentRestoreReply,
    AgentResumeReply,
    AgentStatusReply,
    ArtifactRef,
    CheckpointDirBody,
    CommonBody,
    ContinuationRow,
    DiscardContinuationBody,
    DiscardContinuationReply,
    ExecutionId,
    ReceiptQuery,
    Sha256Hex,
    StatusQuery,
    agent_instance_dir,
    agent_record_file,
    capture_key,
    route,
    sha256_hex,
)
from quiesce.tools.gymsim.base import GymServer
from quiesce.tools.gymsim.common import (
    RESTORE_FAILED,
    ArtifactWriter,
    ControlRejection,
    Notifier,
    count_records,
    error_response,
    jsonl_bytes,
    manifest_bytes,
)
from quiesce.tools.gymsim.fence import OpRule, rule

#: How long a rollout keeps retrying a peer that does not answer before it fails.
TRANSPORT_RETRY_S = 30.0
#: Wait between retries of a closed resources admission (no retry-after on that reply).
RESOURCES_RETRY_S = 0.05

RolloutId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=CHECKPOINT_ID_PATTERN)]


class PlainReceipt(ExecutionId):
    """A completion receipt in the five fields of the first receipt agents (nothing more)."""

    execution_generation: Annotated[int, Field(ge=1)]
    result_identity: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    result_digest: Sha256Hex


class LineageReceipt(PlainReceipt):
    """The latest agents' receipt: the model-lineage pair too, both set or both null."""

    manifest_capture_key: RolloutId | None = None
    terminal_model_call_id: Annotated[str, StringConstraints(min_length=1)] | None = None

    @model_validator(mode="after")
    def _lineage_pair(self) -> LineageReceipt:
        if (self.manifest_capture_key is None) != (self.terminal_model_call_id is None):
            raise ValueError("manifest_capture_key and terminal_model_call_id go together")
        return self


def _unique(executions: list[PlainReceipt]) -> list[PlainReceipt]:
    keys = [(e.rollout_id, e.attempt_index) for e in executions]
    if len(keys) != len(set(keys)):
        raise ValueError("completed execution acknowledgements must be unique")
    return executions


class PlainReceiptBody(BaseModel):
    """`acknowledge-completed` of a `receipt_status` / `receipt_plain` agent."""

    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1] = 1
    executions: Annotated[list[PlainReceipt], Field(min_length=1)]

    _unique = field_validator("executions")(_unique)


class LineageReceiptBody(BaseModel):
    """`acknowledge-completed` of a `receipt` agent."""

    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1] = 1
    executions: Annotated[list[LineageReceipt], Field(min_length=1)]

    _unique = field_validator("executions")(_unique)


ReceiptBody = PlainReceiptBody | LineageReceiptBody


class RunBody(BaseModel):
    """`POST /run`: start execution (`rollout_id`, `attempt_index`) of a rollout of `turns` turns."""

    model_config = ConfigDict(extra="forbid")
    rollout_id: RolloutId
    turns: int = Field(ge=1, le=1_000_000)
    attempt_index: int = Field(default=0, ge=0)


class RolloutFailed(Exception):
    pass


def initial_digest(rollout_id: str) -> str:
    return sha256_hex(f"gymsim-rollout|{rollout_id}".encode())


@dataclass
class Rollout:
    """One rollout; `turns_done`, `digest`, `turn_log`, ids and revisions change only at a boundary."""

    rollout_id: str
    turns: int
    attempt_index: int = 0
    turns_done: int = 0
    digest: str = ""
    turn_log: list[dict[str, Any]] = field(default_factory=list)
    status: str = "running"  # running | parked | blocked | completed | failed | restored
    result: dict[str, Any] | None = None
    error: str | None = None
    last_model_call_id: str | None = None
    revisions: dict[str, int] = field(default_factory=dict)
    restored_from: list[dict[str, Any]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    #: the consumer acknowledged the finished result: released, never part of a checkpoint again
    acknowledged: bool = False
    started: float = field(default_factory=time.time)

    @property
    def capture_key(self) -> str:
        return capture_key(self.rollout_id, self.attempt_index)

    def view(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id,
            "attempt_index": self.attempt_index,
            "capture_key": self.capture_key,
            "status": self.status,
            "turns": self.turns,
            "turns_done": self.turns_done,
            "digest": self.digest,
            "turn_log": self.turn_log,
            "result": self.result,
            "error": self.error,
            "last_committed_model_call_id": self.last_model_call_id,
            "resource_state_revisions": self.revisions,
            "restored_from": self.restored_from,
            "acknowledged": self.acknowledged,
        }

    def boundary_record(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "rollout_id": self.rollout_id,
            "attempt_index": self.attempt_index,
            "capture_key": self.capture_key,
            "status": "completed" if self.status == "completed" else "parked",
            "turns": self.turns,
            "turns_done": self.turns_done,
            "digest": self.digest,
            "turn_log": self.turn_log,
            "result": self.result,
            "last_committed_model_call_id": self.last_model_call_id,
            "resource_state_revisions": self.revisions,
            "restored_from": self.restored_from,
        }

    def receipt(self, lineage: bool) -> dict[str, Any]:
        """Later Gym's completion receipt of the held result, as the agent shows it: generation 1,
        the result's identity and the sha256 of its canonical JSON; with `lineage`, also the last
        committed model call and its capture key (both null when there is none)."""
        assert self.result is not None
        payload = json.dumps(self.result, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        receipt: dict[str, Any] = {
            "rollout_id": self.rollout_id,
            "attempt_index": self.attempt_index,
            "execution_generation": 1,
            "result_identity": f"{self.capture_key}-result",
            "result_digest": sha256_hex(payload.encode()),
        }
        if lineage:
            known = self.last_model_call_id is not None
            receipt["manifest_capture_key"] = self.capture_key if known else None
            receipt["terminal_model_call_id"] = self.last_model_call_id
        return receipt

    def continuation_row(self) -> dict[str, Any]:
        row = ContinuationRow(
            rollout_id=self.rollout_id,
            attempt_index=self.attempt_index,
            capture_key=self.capture_key,
            last_committed_model_call_id=self.last_model_call_id,
            resource_state_revisions=dict(self.revisions),
        )
        return row.model_dump(mode="json")


class AgentServer(GymServer):
    """An agent server: runs rollouts against its policy model and resources server."""

    component = AGENT
    concurrency_contract = "serialized_per_session"
    features = ("agent_continuation_index_v1", "agent_boundary_records_v1")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.rollouts: dict[str, Rollout] = {}
        #: executions a restore retired: their `/run` answers 409 `stale_attempt`, for this process's life
        self.tombstones: set[tuple[str, int]] = set()
        self.park_requested = False
        self.changed = Notifier()
        super().__init__(*args, **kwargs)

    @property
    def stateful(self) -> bool:
        return self.spec.checkpoint_mode == "export_restore"

    @property
    def receipts(self) -> bool:
        """Later Gym: acknowledgements name completion receipts (see the module docstring)."""
        return self.spec.acknowledgement != "pair"

    @property
    def lineage(self) -> bool:
        """The latest agents: a receipt carries the model-lineage pair."""
        return self.spec.acknowledgement == "receipt"

    def held_receipt(self, rollout: Rollout) -> dict[str, Any]:
        """The receipt of a held result in this agent version's fields."""
        return rollout.receipt(self.lineage)

    def feature_list(self) -> list[str]:
        if not self.stateful:
            return list(self.features)
        later = [DISCARD_RESTORED_CONTINUATION, AGENT_RESOURCE_DEPENDENCY_INDEX] if self.spec.discard else []
        return [*self.features, COMPLETED_RESULT_ACKNOWLEDGEMENT, *later]

    def admission_state(self) -> str:
        if not self.park_requested:
            return "accepting"
        return "draining" if self._with_status("running") else "paused"

    def fence_rules(self) -> dict[str, OpRule]:
        return {
            "prepare": rule(("idle",), "preparing", "prepared"),
            "commit": rule(("prepared",), "committing", "committed_paused"),
            "restore": rule(("idle",), "restoring", "restored_paused"),
            "resume": rule(
                ("idle", "preparing", "prepared", "committed_paused", "restored_paused"),
                None,
                "idle",
                retires=True,
            ),
        }

    async def aclose(self) -> None:
        await super().aclose()
        tasks = [r.task for r in self.rollouts.values() if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- routes ------------------------------------------------------------------------------

    def add_routes(self) -> None:
        app = self.app

        @app.post("/run")
        async def run(body: RunBody) -> JSONResponse:
            key = (body.rollout_id, body.attempt_index)
            if key in self.tombstones:
                return error_response(
                    409,
                    STALE_ATTEMPT,
                    f"rollout {body.rollout_id!r} attempt {body.attempt_index} was retired by restore",
                )
            existing = self.rollouts.get(body.rollout_id)
            continues = (
                existing is not None
                and existing.status == "restored"
                and existing.attempt_index == body.attempt_index
            )
            if existing is not None and not continues:
                return error_response(409, "rollout_exists", f"rollout {body.rollout_id} already exists")
            if self.park_requested:
                return error_response(
                    409, CHECKPOINT_PARKED, "agent admission is closed", headers={"retry-after": "1"}
                )
            if existing is not None:  # the restored continuation: from its saved boundary
                rollout = existing
                rollout.status = "running"
                rollout.started = time.time()
            else:
                rollout = Rollout(
                    body.rollout_id,
                    body.turns,
                    attempt_index=body.attempt_index,
                    digest=initial_digest(body.rollout_id),
                )
                self.rollouts[rollout.rollout_id] = rollout
            self._start(rollout)
            return JSONResponse(
                {
                    "rollout_id": rollout.rollout_id,
                    "attempt_index": rollout.attempt_index,
                    "status": rollout.status,
                }
            )

        @app.get("/rollouts")
        async def rollouts() -> JSONResponse:
            return JSONResponse({"rollouts": [self.rollouts[k].view() for k in sorted(self.rollouts)]})

        @app.get("/rollouts/{rollout_id}")
        async def one_rollout(rollout_id: str) -> JSONResponse:
            rollout = self.rollouts.get(rollout_id)
            if rollout is None:
                raise HTTPException(404, f"no rollout {rollout_id}")
            return JSONResponse(rollout.view())

        @self.control_route("POST", route(AGENT, "prepare").full_path)
        async def prepare(body: CommonBody) -> JSONResponse:
            return await self.control("prepare", body, lambda: self._prepare(body))

        @self.control_route("GET", route(AGENT, "status").full_path)
        async def status(q: Annotated[StatusQuery, Query()]) -> JSONResponse:
            return await self.query(lambda: self._status(q))

        @self.control_route("POST", route(AGENT, "commit").full_path)
        async def commit(body: CheckpointDirBody) -> JSONResponse:
            return await self.control("commit", body, lambda: self._commit(body))

        @self.control_route("POST", route(AGENT, "restore").full_path)
        async def restore(body: CheckpointDirBody) -> JSONResponse:
            return await self.control("restore", body, lambda: self._restore(body))

        @self.control_route("POST", route(AGENT, "resume").full_path)
        async def resume(body: CommonBody) -> JSONResponse:
            return await self.control("resume", body, self._resume)

        if self.stateful and self.spec.discard:

            @self.control_route("POST", route(AGENT, "discard").full_path)
            async def discard(body: DiscardContinuationBody) -> JSONResponse:
                return await self.query(lambda: self._discard(body))

        if self.stateful and not self.receipts:

            @self.control_route("POST", route(AGENT, "acknowledge").full_path)
            async def acknowledge(body: AcknowledgeBody) -> JSONResponse:
                return await self.query(lambda: self._acknowledge(body))

        if self.stateful and self.receipts and not self.lineage:

            @self.control_route("POST", route(AGENT, "acknowledge").full_path)
            async def acknowledge_plain(body: PlainReceiptBody) -> JSONResponse:
                return await self.query(lambda: self._acknowledge(body))

        if self.stateful and self.lineage:

            @self.control_route("POST", route(AGENT, "acknowledge").full_path)
            async def acknowledge_lineage(body: LineageReceiptBody) -> JSONResponse:
                return await self.query(lambda: self._acknowledge(body))

        if self.stateful and self.spec.acknowledgement in ("receipt_plain", "receipt"):

            @self.control_route("GET", route(AGENT, "receipt").full_path)
            async def receipt(q: Annotated[ReceiptQuery, Query()]) -> JSONResponse:
                return await self.query(lambda: self._receipt(q))

    # -- rollouts ----------------------------------------------------------------------------

    def _start(self, rollout: Rollout) -> None:
        rollout.task = asyncio.get_running_loop().create_task(
            self._drive(rollout), name=f"rollout {rollout.rollout_id}"
        )

    def _with_status(self, *statuses: str) -> list[Rollout]:
        return [r for r in self.rollouts.values() if r.status in statuses]

    async def _drive(self, rollout: Rollout) -> None:
        try:
            while True:
                await self._boundary(rollout)
                if rollout.turns_done >= rollout.turns:
                    break
                await self._turn(rollout)
            await self._finish(rollout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            rollout.status = "failed"
            rollout.error = f"{type(exc).__name__}: {exc}"
            self.changed.notify()

    async def _boundary(self, rollout: Rollout) -> None:
        """Park here while a checkpoint asks for it (stateful agents only)."""
        while self.park_requested and self.stateful:
            if rollout.status != "parked":
                rollout.status = "parked"
                self.changed.notify()
            await self.changed.wait(None)
        if rollout.status != "running":
            rollout.status = "running"
            self.changed.notify()

    def _headers(self, rollout: Rollout) -> dict[str, str]:
        return {ROLLOUT_ID_HEADER: rollout.rollout_id, ATTEMPT_INDEX_HEADER: str(rollout.attempt_index)}

    async def _post(self, url: str, document: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
        client = self.ctx.http.get()
        give_up = time.monotonic() + TRANSPORT_RETRY_S
        while True:
            try:
                return await client.post(url, json=document, headers=headers)
            except httpx.TransportError as exc:
                if time.monotonic() >= give_up:
                    raise RolloutFailed(f"{url} unreachable: {exc!r}") from exc
                await asyncio.sleep(0.1)

    async def _turn(self, rollout: Rollout) -> None:
        """Run the next turn, or return unchanged if the model refused it (`checkpoint_parked`)."""
        turn = rollout.turns_done + 1
        headers = self._headers(rollout)
        policy_url = self.ctx.peer_url(self.spec.policy or "")
        reply = await self._post(
            f"{policy_url}/v1/responses",
            {
                "model": self.spec.policy,
                "input": f"{rollout.rollout_id}|turn {turn}|{rollout.digest}",
                "metadata": {"turn": turn},
            },
            headers,
        )
        if reply.status_code == 409 and _code(reply) == CHECKPOINT_PARKED:
            rollout.status = "blocked"
            self.changed.notify()
            await self.changed.wait(_retry_after(reply))
            return
        if reply.status_code != 200:
            raise RolloutFailed(f"model call of turn {turn} answered {reply.status_code}: {reply.text[:200]}")
        body = reply.json()
        output = str(body["output_text"])
        call_id = body.get("metadata", {}).get("model_call_id")
        tool_result: str | None = None
        revision: int | None = None
        if self.spec.resources is not None:
            resources_url = self.ctx.peer_url(self.spec.resources)
            while True:
                tool = await self._post(
                    f"{resources_url}/tools/step", {"input": output, "turn": turn}, headers
                )
                if tool.status_code == 409 and _code(tool) == RESOURCES_ADMISSION_CLOSED:
                    await self.changed.wait(RESOURCES_RETRY_S)
                    continue
                if tool.status_code != 200:
                    raise RolloutFailed(
                        f"tool call of turn {turn} answered {tool.status_code}: {tool.text[:200]}"
                    )
                break
            tool_result = str(tool.json()["result"])
            revision = int(tool.headers[RESOURCE_REVISION_HEADER])
        # The boundary: everything of the turn is applied in one step.
        rollout.digest = sha256_hex(json.dumps([rollout.digest, turn, output, tool_result]).encode("utf-8"))
        rollout.turns_done = turn
        rollout.last_model_call_id = call_id
        if revision is not None and self.spec.resources is not None:
            rollout.revisions[_resources_key(self.spec.resources, self.ctx.instances)] = revision
        rollout.turn_log.append(
            {
                "turn": turn,
                "attempt_index": rollout.attempt_index,
                "model_call_id": call_id,
                "resource_revision": revision,
                "output": output[:16],
                "tool_result": tool_result,
            }
        )
        self.changed.notify()

    async def _finish(self, rollout: Rollout) -> None:
        reward: float | None = None
        verdict: str | None = None
        if self.spec.resources is not None:
            resources_url = self.ctx.peer_url(self.spec.resources)
            reply = await self._post(
                f"{resources_url}/verify",
                {
                    "rollout_id": rollout.rollout_id,
                    "attempt_index": rollout.attempt_index,
                    "digest": rollout.digest,
                },
                self._headers(rollout),
            )
            if reply.status_code != 200:
                raise RolloutFailed(f"verify answered {reply.status_code}: {reply.text[:200]}")
            body = reply.json()
            reward = float(body["reward"])
            verdict = str(body["verdict"])
        rollout.result = {
            "rollout_id": rollout.rollout_id,
            "turns": rollout.turns_done,
            "digest": rollout.digest,
            "reward": reward,
            "verdict": verdict,
        }
        rollout.status = "completed"
        self.changed.notify()

    # -- control operations ------------------------------------------------------------------

    def _participants(self) -> list[Rollout]:
        """The rollouts a checkpoint concerns: every unreleased one of a stateful agent (a failed
        rollout is retired, an acknowledged one released)."""
        if not self.stateful:
            return []
        return [
            r for r in self.rollouts.values() if r.status not in ("failed", "restored") and not r.acknowledged
        ]

    def _execution(self, rollout: Rollout) -> dict[str, Any]:
        """A rollout as Gym's execution status: a blocked model call leaves it parked at its boundary."""
        parked = rollout.status in ("parked", "blocked")
        if parked:
            state = "parked"
        elif rollout.status == "completed":
            state = "completed"
        else:
            state = "park_requested" if self.park_requested else "running"
        return {
            "rollout_id": rollout.rollout_id,
            "attempt_index": rollout.attempt_index,
            "generation": 1,
            "state": state,
            "parked_boundary_state": "parked_with_boundary" if parked else None,
            "boundary_index": rollout.turns_done,
            **(
                {"completion_receipt": self.held_receipt(rollout)}
                if self.receipts and rollout.status == "completed"
                else {}
            ),
            "age_seconds": round(max(0.0, time.time() - rollout.started), 3),
        }

    def _counters(self) -> dict[str, Any]:
        """Exactly the anchor's prepare fields (RL's strict model refuses any other)."""
        rollouts = sorted(self._participants(), key=lambda r: r.capture_key)
        running = [r for r in rollouts if r.status == "running"]
        parked = [r for r in rollouts if r.status in ("parked", "blocked")]
        completed = [r for r in rollouts if r.status == "completed"]
        return {
            "state": "preparing" if self.park_requested else "accepting",
            "ready_to_commit": not running and not completed,
            "running": len(running),
            "parked": len(parked),
            "parked_with_boundary": len(parked),
            "parked_without_boundary": 0,
            "completed_unacknowledged": len(completed),
            "active": len(running) + len(parked),
            "blocking_attempts": [self._execution(r) for r in running],
            "completed_unacknowledged_attempts": [self._execution(r) for r in completed],
            "executions": [self._execution(r) for r in rollouts],
        }

    async def _prepare(self, body: CommonBody) -> dict[str, Any]:
        if self.stateful:
            self.park_requested = True
            self.changed.notify()
        budget = body.budget_s(time.time())
        until = time.monotonic() + budget - min(0.25, budget * 0.1)
        while self._with_status("running") and self.stateful:
            left = until - time.monotonic()
            if left <= 0:
                break
            await self.changed.wait(left)
        counters = self._counters()
        if not counters["ready_to_commit"]:
            raise ControlRejection(
                AGENT_PREPARE_INCOMPLETE,
                f"agent prepare is incomplete: running={counters['running']},"
                f" parked_without_boundary={counters['parked_without_boundary']},"
                f" completed_unacknowledged={counters['completed_unacknowledged']}",
            )
        return AgentPrepareReply.model_validate(counters).model_dump(mode="json")

    async def _acknowledge(self, body: AcknowledgeBody | ReceiptBody) -> dict[str, Any]:
        """Release held results: the whole batch is checked before any is released."""
        chosen: list[Rollout] = []
        for execution in body.executions:
            rollout = self._held(execution.rollout_id, execution.attempt_index)
            given = execution.model_dump(mode="json")
            if isinstance(execution, PlainReceipt) and given != self.held_receipt(rollout):
                raise ControlRejection(
                    COMPLETED_EXECUTION_ACKNOWLEDGEMENT_ERROR,
                    f"acknowledgement receipt mismatch for rollout {execution.rollout_id!r} attempt"
                    f" {execution.attempt_index}",
                )
            chosen.append(rollout)
        for rollout in chosen:
            rollout.acknowledged = True
        self.changed.notify()
        reply = AcknowledgeReply.model_validate(
            {"acknowledged": [e.model_dump(mode="json") for e in body.executions]}
        )
        return reply.model_dump(mode="json")

    def _held(self, rollout_id: str, attempt_index: int) -> Rollout:
        """The rollout holding (or that held, until acknowledged) this execution's finished result,
        else a 409 naming why not."""
        rollout = self.rollouts.get(rollout_id)
        if rollout is None or rollout.attempt_index != attempt_index:
            raise ControlRejection(
                COMPLETED_EXECUTION_ACKNOWLEDGEMENT_ERROR,
                f"rollout {rollout_id!r} attempt {attempt_index} has no completed result to acknowledge",
            )
        if rollout.status != "completed":
            raise ControlRejection(
                COMPLETED_EXECUTION_ACKNOWLEDGEMENT_ERROR,
                f"rollout {rollout_id!r} attempt {attempt_index} is {rollout.status},"
                " not completed with a held result",
            )
        return rollout

    async def _receipt(self, q: ReceiptQuery) -> dict[str, Any]:
        rollout = self._held(q.rollout_id, q.attempt_index)
        if rollout.acknowledged:  # released: Gym keeps no receipt of it
            raise ControlRejection(
                COMPLETED_EXECUTION_ACKNOWLEDGEMENT_ERROR,
                f"rollout {q.rollout_id!r} attempt {q.attempt_index} has no completed result receipt",
            )
        return self.held_receipt(rollout)

    async def _status(self, q: StatusQuery) -> dict[str, Any]:
        document = {"checkpoint_id": q.checkpoint_id, **self._counters()}
        return AgentStatusReply.model_validate(document).model_dump(mode="json")

    async def _commit(self, body: CheckpointDirBody) -> dict[str, Any]:
        rollouts = sorted(
            (r for r in self._participants() if r.status in ("parked", "blocked")),
            key=lambda r: r.capture_key,
        )
        if any(r.status == "running" for r in self._participants()):
            raise ControlRejection(AGENT_PREPARE_INCOMPLETE, "a rollout is running; prepare again")
        records = [r.boundary_record() for r in rollouts]
        rows = [r.continuation_row() for r in rollouts if r.last_model_call_id is not None]
        folder = agent_instance_dir(self.instance)

        def write() -> tuple[str, ArtifactRef]:
            writer = ArtifactWriter(body.checkpoint_dir, folder)
            files: dict[str, str] = {}
            for record in records:
                name = agent_record_file(record["rollout_id"], record["attempt_index"])
                data = (json.dumps(record, sort_keys=True, indent=2) + "\n").encode("utf-8")
                files[name] = writer.write(name, data, 1).sha256
            data, count = jsonl_bytes(rows)
            index = writer.write(AGENT_CONTINUATIONS, data, count)
            manifest = AgentManifest(
                checkpoint_id=body.checkpoint_id,
                instance_name=self.instance,
                files=files,
                continuation_index=index,
            )
            digest = writer.write_manifest(manifest.model_dump(mode="json"), list_files=False)
            return digest, index

        digest, index = await asyncio.to_thread(write)
        reply = AgentCommitReply(records=len(records), manifest_digest=digest, continuation_index=index)
        return reply.model_dump(mode="json")

    async def _restore(self, body: CheckpointDirBody) -> dict[str, Any]:
        folder = agent_instance_dir(self.instance)
        manifest, records = await asyncio.to_thread(read_agent_checkpoint, body.checkpoint_dir, folder)
        if manifest.instance_name != self.instance:
            raise ControlRejection(
                RESTORE_FAILED,
                f"agent checkpoint belongs to instance {manifest.instance_name!r}, not {self.instance!r}",
            )
        index = manifest.continuation_index
        source_id = manifest.checkpoint_id
        try:
            restored = [self._from_record(record, source_id) for record in records]
        except (KeyError, TypeError, ValueError) as exc:
            raise ControlRejection(RESTORE_FAILED, f"bad agent checkpoint in {folder}: {exc!r}") from exc
        if self.stateful:
            self.park_requested = True
        for rollout in restored:  # installed, not started: the trainer's `/run` of attempt n+1 runs it
            old = self.rollouts.get(rollout.rollout_id)
            if old is not None and old.task is not None:
                old.task.cancel()
            self.rollouts[rollout.rollout_id] = rollout
            self.tombstones.add((rollout.rollout_id, rollout.attempt_index - 1))
        self.changed.notify()
        reply = AgentRestoreReply(
            records=len(restored), source_checkpoint_id=source_id, continuation_index=index
        )
        return reply.model_dump(mode="json")

    def _from_record(self, record: dict[str, Any], source_id: str) -> Rollout:
        attempt = int(record["attempt_index"])
        completed = record["status"] == "completed"
        return Rollout(
            rollout_id=str(record["rollout_id"]),
            turns=int(record["turns"]),
            attempt_index=attempt + 1,
            turns_done=int(record["turns_done"]),
            digest=str(record["digest"]),
            turn_log=list(record["turn_log"]),
            status="restored",
            result=record.get("result") if completed else None,
            last_model_call_id=record.get("last_committed_model_call_id"),
            revisions={str(k): int(v) for k, v in dict(record.get("resource_state_revisions") or {}).items()},
            restored_from=[
                *record.get("restored_from", []),
                {
                    "checkpoint_id": source_id,
                    "attempt_index": attempt,
                    "turns_done": int(record["turns_done"]),
                },
            ],
        )

    async def _discard(self, body: DiscardContinuationBody) -> dict[str, Any]:
        """Drop the restored continuation of (rollout, n+1), only while `restored_paused` under
        `checkpoint_id` (409 as the fence refuses otherwise): its `/run` then starts from the task;
        (rollout, n) stays retired. An execution already running is 409 `duplicate_execution`;
        nothing installed for it answers `discarded: false`."""
        self.fence.check_query(body.checkpoint_id, frozenset({"restored_paused"}))
        rollout = self.rollouts.get(body.rollout_id)
        mine = rollout is not None and rollout.attempt_index == body.attempt_index
        if mine and rollout is not None and rollout.status != "restored":
            raise ControlRejection(
                DUPLICATE_EXECUTION,
                f"rollout {body.rollout_id!r} attempt {body.attempt_index} is already active",
            )
        if mine:
            del self.rollouts[body.rollout_id]
            self.changed.notify()
        return DiscardContinuationReply(discarded=mine).model_dump(mode="json")

    async def _resume(self) -> dict[str, Any]:
        released = len(self._with_status("parked", "blocked")) if self.park_requested else 0
        self.park_requested = False
        self.changed.notify()
        return AgentResumeReply(state="accepting", released=released).model_dump(mode="json")


def read_agent_checkpoint(checkpoint_dir: str, folder: str) -> tuple[AgentManifest, list[dict[str, Any]]]:
    """Read an agent's folder as Gym writes it (module docstring): the manifest, then every record
    file it names, each against its sha256, then the continuation index against its reference and
    against the records (exactly one row per record with a model call id). Raises
    `ControlRejection(restore_failed)` naming the first problem; records in manifest order."""
    root = Path(checkpoint_dir)
    try:
        manifest = AgentManifest.model_validate_json(manifest_bytes(checkpoint_dir, folder))
    except ValueError as exc:
        raise ControlRejection(RESTORE_FAILED, f"unreadable manifest {folder}/manifest.json: {exc}") from exc
    records: list[dict[str, Any]] = []
    for name, digest in manifest.files.items():
        if "/" in name or name.startswith("."):
            raise ControlRejection(RESTORE_FAILED, f"{folder}/manifest.json names a bad record file {name!r}")
        try:
            data = (root / folder / name).read_bytes()
        except OSError as exc:
            raise ControlRejection(RESTORE_FAILED, f"missing file {folder}/{name}") from exc
        if sha256_hex(data) != digest:
            raise ControlRejection(RESTORE_FAILED, f"digest mismatch for {folder}/{name}")
        try:
            record = json.loads(data)
        except ValueError as exc:
            raise ControlRejection(RESTORE_FAILED, f"{folder}/{name} is not JSON") from exc
        if not isinstance(record, dict):
            raise ControlRejection(RESTORE_FAILED, f"{folder}/{name} is not a record")
        records.append(record)
    index = manifest.continuation_index
    try:
        data = (root / index.relative_path).read_bytes()
    except OSError as exc:
        raise ControlRejection(RESTORE_FAILED, f"missing file {index.relative_path}") from exc
    if len(data) != index.bytes or sha256_hex(data) != index.sha256 or count_records(data) != index.records:
        raise ControlRejection(RESTORE_FAILED, f"digest mismatch for {index.relative_path}")
    try:
        rows = {
            (row.rollout_id, row.attempt_index, row.last_committed_model_call_id)
            for row in (
                ContinuationRow.model_validate_json(line) for line in data.splitlines() if line.strip()
            )
        }
        expected = {
            (str(r["rollout_id"]), int(r["attempt_index"]), r["last_committed_model_call_id"])
            for r in records
            if r.get("last_committed_model_call_id") is not None
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ControlRejection(RESTORE_FAILED, f"bad agent checkpoint in {folder}: {exc!r}") from exc
    if rows != expected or len(rows) != index.records:
        raise ControlRejection(
            RESTORE_FAILED, f"{index.relative_path} does not match the committed boundary records"
        )
    return manifest, records


def _resources_key(name_or_url: str, instances: Mapping[str, str]) -> str:
    """The key of `resource_state_revisions`: the resources server's name — the one it reports
    (its `instance`) when it is a server of this cluster."""
    if "://" in name_or_url:
        return name_or_url.rstrip("/").rsplit("/", 1)[-1]
    return instances.get(name_or_url, name_or_url)


def _code(reply: httpx.Response) -> str | None:
    try:
        body = reply.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def _retry_after(reply: httpx.Response) -> float:
    try:
        return max(0.01, float(reply.headers.get("retry-after", "1")))
    except ValueError:
        return 1.0
